"""Write the credentials of a ctrps deployment into a new directory, one file each.

    python deploy/make_secrets.py deploy/secrets

- ``cluster-secret``: the cluster secret (the shards only);
- ``worker-token``: the train-scope shard token (the workers), what
  ``ctrps token --scope train`` prints for that secret;
- ``api-shard-token``: the admin-scope shard token (the API: its admin routes
  export through shard 0);
- ``admin-token``: the API's own admin token (for people; unrelated to the secret);
- ``replica-admin-token``: the serving replicas' admin token, their own, so
  that a replica's pod never holds the API's.

The directory is created (mode 0700; an existing one is refused, so nothing
is overwritten) and every file is mode 0600. docker-compose.yml reads these
files as compose secrets; for Kubernetes the script prints the ``kubectl
create secret`` commands that load them (values never on a command line).
Nothing secret is printed.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from ps_core.net.auth import Scope, derive_token, new_secret

FILES = ("cluster-secret", "worker-token", "api-shard-token", "admin-token", "replica-admin-token")

KUBERNETES = {
    # Secret name: (key, file). Each is mounted only into the pods that use it.
    "ctrps-cluster-secret": ("secret", "cluster-secret"),
    "ctrps-worker-token": ("token", "worker-token"),
    "ctrps-api-shard-token": ("token", "api-shard-token"),
    "ctrps-admin-token": ("token", "admin-token"),
    "ctrps-replica-admin-token": ("token", "replica-admin-token"),
}


def make(directory: Path) -> dict[str, Path]:
    """Create `directory` holding a fresh set of credentials; their paths by name."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=False)
    secret = new_secret()
    values = {
        "cluster-secret": secret,
        "worker-token": derive_token(secret, Scope.TRAIN),
        "api-shard-token": derive_token(secret, Scope.ADMIN),
        "admin-token": secrets.token_urlsafe(32),
        "replica-admin-token": secrets.token_urlsafe(32),
    }
    paths = {}
    for name, value in values.items():
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(value + "\n")
        paths[name] = path
    return paths


def kubectl_commands(directory: Path, namespace: str = "") -> list[str]:
    """The commands that load `directory`'s files as the manifests' Secrets."""
    ns = f" --namespace {namespace}" if namespace else ""
    return [
        f"kubectl create secret generic {name}{ns} --from-file={key}={directory / file}"
        for name, (key, file) in KUBERNETES.items()
    ]


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python deploy/make_secrets.py DIR [NAMESPACE]", file=sys.stderr)
        return 2
    directory = Path(argv[0])
    try:
        make(directory)
    except FileExistsError:
        print(f"{directory} exists: choose a new directory (nothing is overwritten)", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(FILES)} to {directory} (mode 0600)")
    print("Kubernetes:")
    for line in kubectl_commands(directory, argv[1] if len(argv) == 2 else ""):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
