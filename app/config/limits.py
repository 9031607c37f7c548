"""The limits of a role's ports (connections, timeouts, buffers), read from
``CTRPS_*`` variables only: a role's settings hold them whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ps_core.net.limits import PortLimits, RpcLimits

from .declared import SettingsError

__all__ = ["port_limits_from_env", "rpc_limits_from_env"]


def _env_number(env: Mapping[str, str], key: str, default: Any) -> Any:
    raw = env.get(key)
    if not raw:
        return default
    try:
        return type(default)(raw)
    except ValueError:
        raise SettingsError(
            f"{key}={raw!r} is not {'an integer' if isinstance(default, int) else 'a number'}"
        ) from None


def port_limits_from_env(env: Mapping[str, str], prefix: str) -> PortLimits:
    """An HTTP port's limits from ``{prefix}_MAX_CONNECTIONS``, ``_HEADER_TIMEOUT``,
    ``_BODY_TIMEOUT`` and ``_IDLE_TIMEOUT`` (seconds), over the defaults."""
    d = PortLimits()
    try:
        return PortLimits(
            max_connections=_env_number(env, f"{prefix}_MAX_CONNECTIONS", d.max_connections),
            header_timeout_s=_env_number(env, f"{prefix}_HEADER_TIMEOUT", d.header_timeout_s),
            body_timeout_s=_env_number(env, f"{prefix}_BODY_TIMEOUT", d.body_timeout_s),
            idle_timeout_s=_env_number(env, f"{prefix}_IDLE_TIMEOUT", d.idle_timeout_s),
        )
    except ValueError as exc:
        if isinstance(exc, SettingsError):
            raise
        raise SettingsError(f"{prefix}_*: {exc}") from None


def rpc_limits_from_env(env: Mapping[str, str]) -> RpcLimits:
    """The RPC port's limits from ``CTRPS_RPC_MAX_CONNECTIONS``, ``CTRPS_RPC_HELLO_TIMEOUT``,
    ``CTRPS_RPC_FRAME_TIMEOUT`` (seconds) and ``CTRPS_RPC_BUFFER_BUDGET_MB``."""
    d = RpcLimits()
    try:
        return RpcLimits(
            max_connections=_env_number(env, "CTRPS_RPC_MAX_CONNECTIONS", d.max_connections),
            hello_timeout_s=_env_number(env, "CTRPS_RPC_HELLO_TIMEOUT", d.hello_timeout_s),
            frame_timeout_s=_env_number(env, "CTRPS_RPC_FRAME_TIMEOUT", d.frame_timeout_s),
            buffer_budget_bytes=_env_number(env, "CTRPS_RPC_BUFFER_BUDGET_MB", d.buffer_budget_bytes >> 20) << 20,
        )
    except ValueError as exc:
        if isinstance(exc, SettingsError):
            raise
        raise SettingsError(f"CTRPS_RPC_*: {exc}") from None
