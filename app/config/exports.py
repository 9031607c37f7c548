"""The export settings the shard, the demo and the cluster share: where
model versions go, how often, with which file mode, and who owns them."""

from __future__ import annotations

from typing import Any

from .declared import SettingsError, setting

__all__ = [
    "octal_mode",
    "exports_dir",
    "export_interval",
    "exports_mode",
    "take_over_exports",
    "check_exports",
    "check_exports_dir",
    "check_exports_location",
    "check_exports_mode",
]


def octal_mode(raw: str) -> int:
    """A file mode written in octal (``0600``, ``640``); ValueError otherwise."""
    return int(raw, 8)


def exports_dir(help: str, off_help: str, *, empty: bool = False) -> Any:
    """``--exports-dir`` / ``--no-exports`` / ``CTRPS_EXPORTS_DIR``."""
    return setting(
        "exports",
        env="CTRPS_EXPORTS_DIR",
        flag="--exports-dir",
        help=help,
        off="--no-exports",
        off_value="",
        off_help=off_help,
        empty=empty,
    )


def export_interval(help: str = "seconds between exports; 0 = only when asked") -> Any:
    """``--export-interval`` / ``CTRPS_EXPORT_INTERVAL``."""
    return setting(60.0, env="CTRPS_EXPORT_INTERVAL", flag="--export-interval", help=help)


def exports_mode() -> Any:
    """``--exports-mode`` / ``CTRPS_EXPORTS_MODE``: an octal file mode."""
    return setting(
        0o600,
        env="CTRPS_EXPORTS_MODE",
        flag="--exports-mode",
        help="octal mode of export files, their directories get x where r: 0600/0700 keeps the model to this "
        "user, 0640 lets the group's replicas read it",
        item=octal_mode,
        metavar="MODE",
        shown_default="0600",
    )


def take_over_exports() -> Any:
    """``--take-over-exports`` / ``CTRPS_TAKE_OVER_EXPORTS``."""
    return setting(
        False,
        env="CTRPS_TAKE_OVER_EXPORTS",
        flag=None,
        off="--take-over-exports",
        off_value=True,
        help="make an exports directory another cluster owns this one's (its owner.json; else refused, exit 4)",
    )


def check_exports(interval_s: float) -> None:
    """An export interval is a finite number of seconds >= 0."""
    if not 0 <= interval_s < float("inf"):
        raise SettingsError("export interval must be a finite number of seconds >= 0")


def check_exports_mode(mode: int) -> None:
    """Export files are readable and writable by their owner, never executable."""
    if mode & ~0o666 or mode & 0o600 != 0o600:
        raise SettingsError(
            f"exports mode {mode:04o} must let the owner read and write, with no x, setuid or sticky bit "
            "(0600, 0640, 0644, ...)"
        )


def check_exports_dir(exports: str) -> None:
    """An exports directory of the demo or the cluster is a local path: their
    restores and directory checks read local directories only, so a URL here
    is refused rather than half used (`ctrps shard` takes a bucket,
    `check_exports_location`)."""
    if "://" in exports:
        raise SettingsError(
            f"exports dir {exports!r}: exports on object storage are not restored from by ctrps demo or "
            "cluster yet; give a local directory"
        )


def check_exports_location(exports: str) -> None:
    """A shard's exports are a local path or ``s3://bucket[/prefix]``: the
    exporter writes there and every shard restores from there."""
    scheme, sep, rest = exports.partition("://")
    if sep and (scheme.lower() != "s3" or not rest.partition("/")[0]):
        raise SettingsError(f"exports dir {exports!r}: give a local directory or s3://bucket/prefix")
