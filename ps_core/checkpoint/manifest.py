"""The manifest of an export version, and the names of its directory and files.

One JSON object per version (``<root>/<model>/<version>/manifest.json``),
documented in docs/export-format.md. `ExportManifest` is its value type:
`to_json` writes it, `from_json` reads and checks it, and anything malformed
is an `ExportCorruptError` naming the manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..errors import ExportCorruptError, PSError
from ..slots import SlotMap
from ..store.snapshot import SnapshotKind
from ..store.table_config import TableConfig
from .stream import StreamIdentity

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ExportManifest",
    "ManifestFile",
    "Offsets",
    "version_dir_name",
    "parse_version_dir",
    "shard_file_name",
    "serving_file_name",
    "check_model_name",
    "parse_offsets_json",
    "manifest_checksum",
]

FORMAT = "ctrps-export"
"""The manifest's ``format`` field."""
FORMAT_VERSION = 3
"""The newest layout version this code reads, and writes for a cut whose
slot map is not even. Version 3 adds the slot map; a cut of the even map is
still written as 2, which a reader of 2 routes exactly as its map says."""
EVEN_FORMAT_VERSION = 2
"""What a cut of the even slot map is written as (`FORMAT_VERSION`)."""
MANIFEST_NAME = "manifest.json"
"""The manifest's file name in a version directory."""
CHECKSUM_FIELD = "manifest_sha256"
"""The manifest's checksum of its own content (`manifest_checksum`); absent
in manifests written before it existed, which still read."""
_VERSION_DIGITS = 10
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")

Offsets = dict[str, dict[int, int]]
"""Next offset to consume, by topic and partition."""


def version_dir_name(version: int) -> str:
    """A version's directory name: zero-padded to 10 digits, so names sort as numbers."""
    if not 0 <= version < 2**32:
        raise ValueError(f"version {version} outside [0, 2**32)")
    return f"{version:0{_VERSION_DIGITS}d}"


def parse_version_dir(name: str) -> int | None:
    """The version a directory name stands for, or None for anything else
    (hidden temporaries such as ``.tmp-...``, stray files)."""
    if name.isascii() and name.isdigit():
        return int(name)
    return None


def shard_file_name(shard: int, table: str) -> str:
    """``shard-<i>.<table>.npz``: one file per shard and table."""
    return f"shard-{shard}.{table}.npz"


def serving_file_name(shard: int, table: str) -> str:
    """``serving-<i>.<table>.npz``: the weights of `shard_file_name`'s rows
    (`ps_core.checkpoint.serving_files`)."""
    return f"serving-{shard}.{table}.npz"


def check_model_name(model: str) -> str:
    """A model name is one path component: 1-64 of ``[A-Za-z0-9_.-]``, not starting with a dot."""
    if not _MODEL_NAME.fullmatch(model):
        raise ValueError(f"bad model name {model!r}: 1-64 of [A-Za-z0-9_.-], not starting with '.'")
    return model


def is_model_name(name: str) -> bool:
    """Whether `name` is a model's (`check_model_name` would take it)."""
    return _MODEL_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class ManifestFile:
    """One data file of a version: the rows of one table on one shard."""

    name: str
    """File name inside the version directory (`shard_file_name`)."""
    shard: int
    """The shard that wrote it (of the version's `num_shards`)."""
    table: str
    """The table whose rows it holds."""
    rows: int
    """Rows it holds."""
    deleted: int
    """Deleted keys it lists (0 in a base)."""
    bytes: int
    """Its exact size."""
    sha256: str
    """Hex SHA-256 of its bytes."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every field, by name."""
        return asdict(self)


@dataclass(frozen=True)
class ExportManifest:
    """What a version directory holds and where it sits in its chain."""

    model: str
    """The model's name (the directory above the version)."""
    version: int
    """This version's number."""
    parent: int | None
    """The version a delta applies on top of; None for a base."""
    kind: SnapshotKind
    """``"base"`` (every row) or ``"delta"`` (rows changed after `parent`, and deletions)."""
    created_at: datetime
    """When the cut was taken (UTC). A compacted base keeps its version's time."""
    model_config: dict[str, Any]
    """The caller's model description (opaque JSON)."""
    num_shards: int
    """How many shards wrote the version (a restore may use any number)."""
    tables: dict[str, TableConfig]
    """The declaration of every table, by name."""
    files: tuple[ManifestFile, ...]
    """Every data file, by shard then table."""
    offsets: Offsets
    """Next offset to consume per topic and partition: where workers resume."""
    compacted_from: tuple[int, ...] = field(default=())
    """For a base written by compaction, the versions it folds (base first); else empty."""
    stream: StreamIdentity | None = None
    """The stream `offsets` were read from (Kafka cluster id, group, topics);
    None in manifests written before streams were recorded, or when no worker
    reported one."""
    serving_files: tuple[ManifestFile, ...] = ()
    """Every serving file (`serving_file_name`), by shard then table; empty
    in versions written before serving files existed."""
    serving_precision: str = "f32"
    """What the serving files hold the weights in: ``f32``, ``f16`` or
    ``int8`` (`ps_core.checkpoint.serving_files`); f32 in older manifests."""
    slot_map: SlotMap | None = None
    """The cluster's slot map at the cut (`ps_core.slots`): which shard each
    key's slot was on. None in manifests written before there were slots,
    whose cuts are the even map of `num_shards` (`cut_slots`)."""

    def cut_slots(self) -> SlotMap:
        """`slot_map`, or the even map of `num_shards` for an older manifest."""
        return self.slot_map if self.slot_map is not None else SlotMap.even(self.num_shards)

    def rows(self) -> int:
        """Rows over all files."""
        return sum(f.rows for f in self.files)

    def deleted(self) -> int:
        """Deleted keys over all files."""
        return sum(f.deleted for f in self.files)

    def nbytes(self) -> int:
        """Bytes of all its files, data and serving."""
        return sum(f.bytes for f in self.files + self.serving_files)

    def to_json(self) -> bytes:
        """The manifest file's bytes (UTF-8 JSON, indented for people)."""
        raw = {
            "format": FORMAT,
            "format_version": EVEN_FORMAT_VERSION if self.slot_map is None or self.slot_map.is_even else FORMAT_VERSION,
            "model": self.model,
            "version": self.version,
            "parent": self.parent,
            "kind": self.kind,
            "created_at": self.created_at.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "num_shards": self.num_shards,
            "model_config": self.model_config,
            "tables": {name: cfg.to_dict() for name, cfg in self.tables.items()},
            "files": [f.to_dict() for f in self.files],
            "offsets": {t: {str(p): o for p, o in sorted(parts.items())} for t, parts in self.offsets.items()},
            "compacted_from": list(self.compacted_from),
            "stream": self.stream.to_dict() if self.stream is not None else None,
            "serving_files": [f.to_dict() for f in self.serving_files],
            "serving_precision": self.serving_precision,
        }
        if self.slot_map is not None:
            raw["slot_map"] = self.slot_map.to_dict()
        raw[CHECKSUM_FIELD] = manifest_checksum(raw)
        return (json.dumps(raw, indent=2, allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str = "manifest.json") -> ExportManifest:
        """Parse and check a manifest; `source` names it in errors."""
        try:
            obj = json.loads(raw)
            _check_checksum(obj, source)
            return cls._from_obj(obj)
        except (ValueError, TypeError, KeyError, AttributeError, PSError) as exc:
            if isinstance(exc, ExportCorruptError):
                raise
            raise ExportCorruptError(
                f"{source}: not a valid export manifest: {type(exc).__name__}: {exc}", file=source
            ) from None

    @classmethod
    def _from_obj(cls, obj: Any) -> ExportManifest:
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        if obj.get("format") != FORMAT:
            raise ValueError(f"format {obj.get('format')!r}, expected {FORMAT!r}")
        fv = obj.get("format_version")
        if not isinstance(fv, int) or not 1 <= fv <= FORMAT_VERSION:
            raise ValueError(f"format_version {fv!r}; this reader knows 1..{FORMAT_VERSION}")
        kind = obj["kind"]
        if kind not in ("base", "delta"):
            raise ValueError(f"kind {kind!r}")
        version, parent = _int(obj["version"]), obj["parent"]
        if parent is not None:
            parent = _int(parent)
        if (kind == "base") != (parent is None) or (parent is not None and parent >= version):
            raise ValueError(f"a {kind} version {version} with parent {parent}")
        num_shards = _int(obj["num_shards"])
        if num_shards < 1:
            raise ValueError("num_shards < 1")
        tables = {str(name): TableConfig.from_dict(cfg) for name, cfg in obj["tables"].items()}
        files = _files(obj["files"], tables, shard_file_name)
        # Absent in older manifests: no serving files.
        serving = _files(obj.get("serving_files", []), tables, serving_file_name)
        model_config = obj["model_config"]
        if not isinstance(model_config, dict):
            raise ValueError("model_config is not an object")
        created = datetime.fromisoformat(str(obj["created_at"]))
        if created.tzinfo is None:
            raise ValueError("created_at without a time zone")
        slot_map = SlotMap.from_dict(obj["slot_map"]) if obj.get("slot_map") is not None else None
        if slot_map is not None and slot_map.num_shards != num_shards:
            raise ValueError(f"a slot map of {slot_map.num_shards} shards in a cut of {num_shards}")
        return cls(
            model=check_model_name(str(obj["model"])),
            version=version,
            parent=parent,
            kind=kind,
            created_at=created.astimezone(UTC),
            model_config=model_config,
            num_shards=num_shards,
            tables=tables,
            files=files,
            offsets=parse_offsets_json(obj["offsets"]),
            compacted_from=tuple(_int(v) for v in obj.get("compacted_from", [])),
            # Absent in older manifests: their offsets' stream is unknown.
            stream=StreamIdentity.from_dict(obj["stream"]) if obj.get("stream") is not None else None,
            serving_files=serving,
            serving_precision=_precision(obj.get("serving_precision", "f32")),
            slot_map=slot_map,
        )


def manifest_checksum(obj: Mapping[str, Any]) -> str:
    """Hex SHA-256 of a manifest's canonical bytes: its JSON object without
    the checksum field, keys sorted, no whitespace, ASCII only."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM_FIELD}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_checksum(obj: Any, source: str) -> None:
    """A manifest whose content does not match its own checksum is damaged,
    refused as a data file whose bytes do not match the manifest's."""
    if not isinstance(obj, dict) or CHECKSUM_FIELD not in obj:
        return  # written before manifests carried one (or not an object: refused below)
    expected = obj[CHECKSUM_FIELD]
    actual = manifest_checksum(obj)
    if actual != expected:
        raise ExportCorruptError(
            f"{source}: sha256 {actual} of its content, its manifest_sha256 says {expected}",
            file=source,
            expected=str(expected),
            actual=actual,
        )


def _precision(raw: Any) -> str:
    if raw not in ("f32", "f16", "int8"):
        raise ValueError(f"serving_precision {raw!r}, expected f32, f16 or int8")
    return str(raw)


def _files(raw: Any, tables: Mapping[str, TableConfig], name_of: Callable[[int, str], str]) -> tuple[ManifestFile, ...]:
    """File entries, each named as `name_of` names its shard and table."""
    files = tuple(
        ManifestFile(
            name=str(f["name"]),
            shard=_int(f["shard"]),
            table=str(f["table"]),
            rows=_int(f["rows"]),
            deleted=_int(f["deleted"]),
            bytes=_int(f["bytes"]),
            sha256=str(f["sha256"]),
        )
        for f in raw
    )
    for f in files:
        # Names come from the manifest: never let one point outside the directory.
        if f.name != name_of(f.shard, f.table) or f.table not in tables:
            raise ValueError(f"file entry {f.name!r} (shard {f.shard}, table {f.table!r})")
    return files


def parse_offsets_json(raw: Any) -> Offsets:
    """``{"<topic>": {"<partition>": offset}}`` (JSON keys are strings) → ints."""
    if not isinstance(raw, Mapping):
        raise ValueError("offsets is not an object")
    out: Offsets = {}
    for topic, parts in raw.items():
        if not isinstance(parts, Mapping):
            raise ValueError(f"offsets of {topic!r} is not an object")
        out[str(topic)] = {int(p): _int(o) for p, o in parts.items()}
    return out


def _int(v: Any) -> int:
    """A non-negative JSON integer (bools refused)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{v!r} is not a non-negative integer")
    return v
