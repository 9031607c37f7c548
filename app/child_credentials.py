"""The cluster's credentials (`ChildCredentials`) and which child process of
`ctrps cluster` gets which: the shards the secret, the workers a train-scope
token, the API an admin-scope one; none inherits any from the cluster."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ps_core.net.auth import Scope, derive_token, new_secret

from .security import SecuritySettings, _secret_from

__all__ = ["ChildCredentials", "CREDENTIAL_VARIABLES"]


CREDENTIAL_VARIABLES = (
    "CTRPS_CLUSTER_SECRET",
    "CTRPS_CLUSTER_SECRET_FILE",
    "CTRPS_SHARD_TOKEN",
    "CTRPS_SHARD_TOKEN_FILE",
    "CTRPS_ADMIN_TOKEN",
    "CTRPS_ADMIN_TOKEN_FILE",
)
"""Never inherited by a child: each gets only what `ChildCredentials.env_for` adds."""


@dataclass(frozen=True)
class ChildCredentials:
    """The cluster's credentials and which child gets which."""

    secret: str = field(repr=False)
    """The cluster secret: the shards verify tokens with it."""
    admin_token: str = field(default="", repr=False)
    """The API's own admin token (``CTRPS_ADMIN_TOKEN`` of this process); empty: none."""
    generated: bool = True
    """Whether `secret` was made for this run (else it was given)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ChildCredentials:
        """The secret of ``CTRPS_CLUSTER_SECRET`` (or ``_FILE``), else a new
        one; `SettingsError` for a short or unreadable one."""
        given = _secret_from(env, "CTRPS_CLUSTER_SECRET")
        SecuritySettings(cluster_secret=given)  # the same checks as a shard's (length)
        return cls(
            secret=given or new_secret(),
            admin_token=_secret_from(env, "CTRPS_ADMIN_TOKEN"),
            generated=not given,
        )

    def env_for(self, kind: str, base: Mapping[str, str]) -> dict[str, str]:
        """`base` without any credential, plus those of a child of `kind`
        (``broker``, ``shard``, ``api``, ``worker`` or ``producer``)."""
        env = {k: v for k, v in base.items() if k not in CREDENTIAL_VARIABLES}
        if kind == "shard":
            env["CTRPS_CLUSTER_SECRET"] = self.secret
        elif kind == "worker":
            env["CTRPS_SHARD_TOKEN"] = derive_token(self.secret, Scope.TRAIN)
        elif kind == "api":
            env["CTRPS_SHARD_TOKEN"] = derive_token(self.secret, Scope.ADMIN)
            if self.admin_token:
                env["CTRPS_ADMIN_TOKEN"] = self.admin_token
        elif kind not in ("broker", "producer"):
            raise ValueError(f"no child of kind {kind!r}")
        return env
