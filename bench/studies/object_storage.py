"""Study: which S3 client library exports go to object storage through.

A real export version (base of N LR rows from 2 shards, written by
`write_version`: ``.npz`` per shard and table, serving files, the manifest)
is uploaded to a real S3-protocol server (moto's, in a subprocess on a free
loopback port: `tests.s3_server.moto_server`) and read back, by each
candidate in its natural asynchronous form:

- ``s3fs``: fsspec's S3 file system (aiobotocore underneath), ``_put`` of
  the data files (a batch, multipart past 50 MiB), then the manifest;
  ``_cat`` to read;
- ``obstore``: Rust's object_store, ``put_async`` of every data file at
  once (multipart past 5 MB, 12 parts in flight), then the manifest;
  ``get_async`` to read;
- ``aiobotocore``: the raw S3 API, ``put_object`` for small files and a
  multipart upload of 8 MiB parts (the caller's code: it has no transfer
  manager) for the rest; ``get_object`` to read.

The server's ceiling, in the same rounds: ``raw_http``, one unsigned aiohttp
PUT per file (moto checks no signature; no parts, no checksum) and GETs.

Baseline, in the same rounds: the local-disk copy of the same files (write
and fsync each, then the directory; read back after dropping them from the
page cache). Rounds alternate the candidates; the figures are MB/s of file
bytes, their ratio to the local disk of the same round, and ranges over the
rounds. Every read is compared byte for byte with the source (untimed).

Also recorded per candidate: whether a second create-only PUT of the
manifest is refused by the server (``If-None-Match: *``, measured), and its
installed size with the distributions it adds to ctrps's own.

Run (from the repository root; needs ``pip install "moto[server]" s3fs obstore aiobotocore``)::

    .venv/bin/python bench/studies/object_storage.py --quick   # 1M rows (44 MB), ~15 s
    .venv/bin/python bench/studies/object_storage.py           # 10M rows (440 MB), ~2.5 min
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata as md
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # bench/: the shared helpers; the root: tests/

from bench_export import distinct_keys, write_base  # noqa: E402
from common import bench_mode, bench_parser, print_result, progress_log  # noqa: E402

from ps_core.checkpoint.manifest import MANIFEST_NAME  # noqa: E402
from tests.s3_server import BUCKET, S3Endpoint, moto_server  # noqa: E402

log = progress_log("object_storage")
PART = 8 << 20
"""aiobotocore's multipart part size (ours to choose: it has no transfer manager)."""
IN_FLIGHT = 8
"""aiobotocore's requests in flight (s3fs and obstore use their own defaults)."""
AIM = 0.7
"""The export's aim: S3 writes at >= 0.7x the local disk's rate."""

# What each library's documentation says (not measured here: moto accepts any credentials).
NOTES: dict[str, dict[str, str]] = {
    "s3fs": {
        "credentials": "botocore's chain: AWS_ACCESS_KEY_ID/SECRET/SESSION_TOKEN, AWS_PROFILE, ~/.aws, IMDS/IRSA",
        "endpoint": "endpoint_url= (or client_kwargs), AWS_ENDPOINT_URL",
        "conditional": "mode='create' on _pipe_file/_put_file: If-None-Match: * (single PUT only)",
        "typed": "no py.typed, no stubs (fsspec untyped)",
    },
    "obstore": {
        "credentials": "AWS_* env (access key, secret, token, region, endpoint); AWS_PROFILE and ~/.aws "
        "only through a credential_provider (obstore.auth.boto3)",
        "endpoint": "endpoint= / AWS_ENDPOINT_URL (allow_http for plain http)",
        "conditional": "mode='create' (If-None-Match: *) and mode={'e_tag': ...} (If-Match); single PUT",
        "typed": "py.typed, full .pyi stubs",
    },
    "aiobotocore": {
        "credentials": "botocore's chain: AWS_ACCESS_KEY_ID/SECRET/SESSION_TOKEN, AWS_PROFILE, ~/.aws, IMDS/IRSA",
        "endpoint": "endpoint_url= , AWS_ENDPOINT_URL",
        "conditional": "put_object(IfNoneMatch='*') / IfMatch=etag; complete_multipart_upload(IfNoneMatch='*')",
        "typed": "no py.typed; stubs in types-aiobotocore[s3] (a separate package)",
    },
}


class Client(Protocol):
    """One candidate: open, upload the files (manifest last), read them back, close."""

    async def start(self) -> None: ...
    async def write(self, files: Sequence[Path], prefix: str) -> None: ...
    async def read(self, names: Sequence[str], prefix: str) -> dict[str, bytes]: ...
    async def put_create(self, key: str, data: bytes) -> bool:
        """A create-only PUT: True if written, False if the server refused it (exists)."""
        ...

    async def close(self) -> None: ...


class S3fsClient:
    def __init__(self, ep: S3Endpoint) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(
            asynchronous=True, endpoint_url=ep.url, key=ep.key_id, secret=ep.secret, skip_instance_cache=True
        )

    async def start(self) -> None:
        self.session = await self.fs.set_session()

    async def write(self, files: Sequence[Path], prefix: str) -> None:
        data, manifest = files[:-1], files[-1]
        await self.fs._put([str(p) for p in data], [f"{BUCKET}/{prefix}/{p.name}" for p in data])
        await self.fs._put_file(str(manifest), f"{BUCKET}/{prefix}/{manifest.name}")

    async def read(self, names: Sequence[str], prefix: str) -> dict[str, bytes]:
        out = await self.fs._cat([f"{BUCKET}/{prefix}/{n}" for n in names])
        return {k.rsplit("/", 1)[1]: v for k, v in out.items()}

    async def put_create(self, key: str, data: bytes) -> bool:
        try:
            await self.fs._pipe_file(f"{BUCKET}/{key}", data, mode="create")
        except FileExistsError:
            return False
        return True

    async def close(self) -> None:
        await self.session.close()


class ObstoreClient:
    def __init__(self, ep: S3Endpoint) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            BUCKET,
            endpoint=ep.url,
            access_key_id=ep.key_id,
            secret_access_key=ep.secret,
            region="us-east-1",
            client_options={"allow_http": True},
        )

    async def start(self) -> None:
        pass

    async def write(self, files: Sequence[Path], prefix: str) -> None:
        import obstore

        await asyncio.gather(*(obstore.put_async(self.store, f"{prefix}/{p.name}", p) for p in files[:-1]))
        await obstore.put_async(self.store, f"{prefix}/{files[-1].name}", files[-1])

    async def read(self, names: Sequence[str], prefix: str) -> dict[str, bytes]:
        import obstore

        async def one(name: str) -> bytes:
            got = await obstore.get_async(self.store, f"{prefix}/{name}")
            return bytes(await got.bytes_async())

        return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))

    async def put_create(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            await obstore.put_async(self.store, key, data, mode="create")
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    async def close(self) -> None:
        pass


class AiobotocoreClient:
    def __init__(self, ep: S3Endpoint) -> None:
        self.ep = ep
        self.limit = asyncio.Semaphore(IN_FLIGHT)

    async def start(self) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        self.ctx = get_session().create_client(
            "s3",
            endpoint_url=self.ep.url,
            aws_access_key_id=self.ep.key_id,
            aws_secret_access_key=self.ep.secret,
            region_name="us-east-1",
            config=AioConfig(max_pool_connections=IN_FLIGHT),
        )
        self.s3 = await self.ctx.__aenter__()

    async def _put(self, path: Path, key: str) -> None:
        data = path.read_bytes()
        if len(data) <= PART:
            async with self.limit:
                await self.s3.put_object(Bucket=BUCKET, Key=key, Body=data)
            return
        up = await self.s3.create_multipart_upload(Bucket=BUCKET, Key=key)

        async def part(i: int) -> dict[str, Any]:
            async with self.limit:
                r = await self.s3.upload_part(
                    Bucket=BUCKET,
                    Key=key,
                    UploadId=up["UploadId"],
                    PartNumber=i + 1,
                    Body=data[i * PART : (i + 1) * PART],
                )
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        parts = await asyncio.gather(*(part(i) for i in range(-(-len(data) // PART))))
        await self.s3.complete_multipart_upload(
            Bucket=BUCKET, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
        )

    async def write(self, files: Sequence[Path], prefix: str) -> None:
        await asyncio.gather(*(self._put(p, f"{prefix}/{p.name}") for p in files[:-1]))
        await self._put(files[-1], f"{prefix}/{files[-1].name}")

    async def read(self, names: Sequence[str], prefix: str) -> dict[str, bytes]:
        async def one(name: str) -> bytes:
            async with self.limit:
                r = await self.s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}")
                async with r["Body"] as body:
                    return bytes(await body.read())

        return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))

    async def put_create(self, key: str, data: bytes) -> bool:
        try:
            await self.s3.put_object(Bucket=BUCKET, Key=key, Body=data, IfNoneMatch="*")
        except self.s3.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("PreconditionFailed", "412"):
                return False
            raise
        return True

    async def close(self) -> None:
        await self.ctx.__aexit__(None, None, None)


class RawHttp:
    """The server's ceiling, not a candidate: one unsigned aiohttp PUT per file
    (moto checks no signature), all at once, and GETs; no checksum, no parts."""

    def __init__(self, ep: S3Endpoint) -> None:
        self.base = f"{ep.url}/{BUCKET}"

    async def start(self) -> None:
        import aiohttp

        self.http = aiohttp.ClientSession()

    async def _put(self, path: Path, key: str) -> int:
        # public-read: moto refuses an unsigned GET of a private object
        async with self.http.put(
            f"{self.base}/{key}", data=path.read_bytes(), headers={"x-amz-acl": "public-read"}
        ) as r:
            return r.status

    async def write(self, files: Sequence[Path], prefix: str) -> None:
        codes = await asyncio.gather(*(self._put(p, f"{prefix}/{p.name}") for p in files[:-1]))
        codes.append(await self._put(files[-1], f"{prefix}/{files[-1].name}"))
        assert set(codes) == {200}, codes

    async def read(self, names: Sequence[str], prefix: str) -> dict[str, bytes]:
        async def one(name: str) -> bytes:
            async with self.http.get(f"{self.base}/{prefix}/{name}") as r:
                r.raise_for_status()
                return await r.read()

        return dict(zip(names, await asyncio.gather(*(one(n) for n in names))))

    async def put_create(self, key: str, data: bytes) -> bool:
        raise NotImplementedError("the ceiling is measured for rates only")

    async def close(self) -> None:
        await self.http.close()


CANDIDATES: dict[str, Callable[[S3Endpoint], Client]] = {
    "s3fs": S3fsClient,
    "obstore": ObstoreClient,
    "aiobotocore": AiobotocoreClient,
}
CLIENTS: dict[str, Callable[[S3Endpoint], Client]] = {**CANDIDATES, "raw_http": RawHttp}


def build_export(root: Path, rows: int, seed: int) -> list[Path]:
    """A base version of `rows` LR rows from 2 shards; its files, manifest last."""
    rng = np.random.default_rng(seed)
    vdir = write_base(root, "m", distinct_keys(rng, rows), rng)
    files = sorted((p for p in vdir.iterdir() if p.is_file() and p.name != MANIFEST_NAME), key=lambda p: p.name)
    return [*files, vdir / MANIFEST_NAME]


def local_copy(files: Sequence[Path], dest: Path) -> tuple[float, float, dict[str, bytes]]:
    """The baseline: seconds to copy `files` into `dest` (each fsynced, then the
    directory), and to read the copies back once out of the page cache."""
    dest.mkdir()
    t = time.perf_counter()
    for p in files:
        with open(p, "rb") as src, open(dest / p.name, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - t
    for p in files:  # what is read next comes from the disk, as an S3 read comes from the server
        with open(dest / p.name, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    t = time.perf_counter()
    got = {p.name: (dest / p.name).read_bytes() for p in files}
    read_s = time.perf_counter() - t
    shutil.rmtree(dest)
    return write_s, read_s, got


async def s3_round(
    name: str, ep: S3Endpoint, files: Sequence[Path], prefix: str
) -> tuple[float, float, float, float, dict[str, bytes]]:
    """One candidate's upload and read-back of `files` under `prefix` (client set up untimed):
    wall seconds of each, the client process's CPU seconds of each (all its threads:
    what the library costs the exporter, whatever the server's speed), the bytes read."""
    client = CLIENTS[name](ep)
    await client.start()
    try:
        t, c = time.perf_counter(), time.process_time()
        await client.write(files, prefix)
        write_s, write_cpu = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        got = await client.read([p.name for p in files], prefix)
        read_s, read_cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        await client.close()
    return write_s, read_s, write_cpu, read_cpu, got


async def conditional(name: str, ep: S3Endpoint) -> str:
    """Whether a second create-only PUT of one key is refused: "refused" (safe
    manifest-last), "overwrote" (the server or library ignored it), or the error."""
    client = CANDIDATES[name](ep)
    await client.start()
    try:
        first = await client.put_create(f"cond-{name}/{MANIFEST_NAME}", b"{}")
        second = await client.put_create(f"cond-{name}/{MANIFEST_NAME}", b"{}")
        return "refused" if first and not second else "overwrote" if first and second else "first refused"
    except Exception as e:  # a library without the option: what it said, as the finding
        return f"error: {type(e).__name__}: {str(e)[:120]}"
    finally:
        await client.close()


_CORE = ("aiohttp", "uvloop", "numpy", "orjson", "prometheus-client", "msgspec")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: Sequence[str]) -> set[str]:
    """The installed distributions `names` need (no extras), themselves included."""
    seen: set[str] = set()
    todo = [_norm(n) for n in names]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        try:
            dist = md.distribution(n)
        except md.PackageNotFoundError:
            continue
        seen.add(n)
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            todo.append(_norm(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]))
    return seen


def footprint(packages: Sequence[str]) -> dict[str, Any]:
    """Installed MB of `packages` and of the distributions they add to ctrps's core."""
    added = sorted(_closure(packages) - _closure(_CORE))
    size = sum(f.size or 0 for n in added for f in md.distribution(n).files or [])
    return {"adds": added, "installed_mb": round(size / 1e6, 1)}


def span(xs: Sequence[float]) -> str:
    return f"{min(xs):.0f}-{max(xs):.0f}" if max(xs) >= 10 else f"{min(xs):.2f}-{max(xs):.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(
        "Upload an export version to an S3 server and read it back with each client library, against the local disk.",
        "1M rows instead of 10M (~15 s)",
        seed=7,
        out_dir=True,
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = parser.parse_args(argv)
    # A stopped run stops its moto server and removes its files too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = 1_000_000 if args.quick else 10_000_000
    import boto3  # moto's own dependency: cleaning the bucket between rounds, outside the figures

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="object-storage-") as tmp, moto_server() as ep:
        root = Path(tmp)
        files = build_export(root / "src", rows, args.seed)
        total = sum(p.stat().st_size for p in files)
        source = {p.name: p.read_bytes() for p in files}
        log(f"export of {rows:,} rows: {len(files)} files, {total / 1e6:.0f} MB; moto at {ep.url}")
        admin = boto3.client(
            "s3",
            endpoint_url=ep.url,
            aws_access_key_id=ep.key_id,
            aws_secret_access_key=ep.secret,
            region_name="us-east-1",
        )
        rates: dict[str, dict[str, list[float]]] = {n: {"write": [], "read": []} for n in ["local", *CLIENTS]}
        ratios: dict[str, dict[str, list[float]]] = {n: {"write": [], "read": []} for n in CLIENTS}
        cpu: dict[str, dict[str, list[float]]] = {n: {"write": [], "read": []} for n in CLIENTS}

        def record(name: str, w: float, r: float, got: dict[str, bytes]) -> None:
            assert got.keys() == source.keys() and all(got[k] == source[k] for k in source), f"{name}: bytes differ"
            rates[name]["write"].append(total / w / 1e6)
            rates[name]["read"].append(total / r / 1e6)

        for rnd in range(args.rounds):
            order = [*CLIENTS][rnd % len(CLIENTS) :] + [*CLIENTS][: rnd % len(CLIENTS)]  # rotated
            w, r, got = local_copy(files, root / f"local-{rnd}")
            record("local", w, r, got)
            del got
            for name in order:
                gc.collect()
                prefix = f"{name}-{rnd}/m/0000000001"
                w, r, wc, rc, got = asyncio.run(s3_round(name, ep, files, prefix))
                record(name, w, r, got)
                cpu[name]["write"].append(wc / (total / 1e9))
                cpu[name]["read"].append(rc / (total / 1e9))
                del got
                for k in ("write", "read"):
                    ratios[name][k].append(rates[name][k][-1] / rates["local"][k][-1])
                admin.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": f"{prefix}/{p.name}"} for p in files]})
            log(
                f"round {rnd + 1}: local {rates['local']['write'][-1]:.0f}/{rates['local']['read'][-1]:.0f} MB/s; "
                + "; ".join(
                    f"{n} {rates[n]['write'][-1]:.0f}/{rates[n]['read'][-1]:.0f} MB/s "
                    f"({ratios[n]['write'][-1]:.2f}x/{ratios[n]['read'][-1]:.2f}x)"
                    for n in CLIENTS
                )
                + " (write/read, ratio to local)"
            )
        conditional_put = {n: asyncio.run(conditional(n, ep)) for n in CANDIDATES}
        log(f"second create-only PUT of a manifest: {conditional_put}")

    result: dict[str, Any] = {
        "bench": "object_storage",
        "mode": bench_mode(args.quick),
        "rows": rows,
        "files": len(files),
        "bytes": total,
        "rounds": args.rounds,
        "aim_write_ratio": AIM,
        "local_write_mb_per_s": rates["local"]["write"],
        "local_read_mb_per_s": rates["local"]["read"],
    }
    packages = {"s3fs": ["s3fs"], "obstore": ["obstore"], "aiobotocore": ["aiobotocore"]}
    print(f"{total / 1e6:.0f} MB in {len(files)} files, {args.rounds} rounds (MB/s ranges; ratio to local disk):")
    print(f"  local        write {span(rates['local']['write'])}  read {span(rates['local']['read'])}")
    for n in CLIENTS:
        med = statistics.median(ratios[n]["write"])
        print(
            f"  {n:12s} write {span(rates[n]['write'])} ({span(ratios[n]['write'])}x)  "
            f"read {span(rates[n]['read'])} ({span(ratios[n]['read'])}x)  "
            f"client CPU s/GB {span(cpu[n]['write'])}/{span(cpu[n]['read'])}  "
            + (f"create-only PUT twice: {conditional_put[n]}  aim met: {med >= AIM}" if n in CANDIDATES else "")
        )
        result[n] = {
            "write_mb_per_s": rates[n]["write"],
            "read_mb_per_s": rates[n]["read"],
            "write_ratio_vs_local": ratios[n]["write"],
            "read_ratio_vs_local": ratios[n]["read"],
            "write_ratio_median": med,
            "client_cpu_s_per_gb_write": cpu[n]["write"],
            "client_cpu_s_per_gb_read": cpu[n]["read"],
        }
        if n in CANDIDATES:
            result[n] |= {"conditional_put": conditional_put[n], "footprint": footprint(packages[n]), "notes": NOTES[n]}
    return print_result(result, args)


if __name__ == "__main__":
    sys.exit(main())
