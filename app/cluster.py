"""``ctrps cluster``: every role as its own process on loopback.

The production topology on one machine: a broker (``ctrps broker``, or the
Kafka at ``CTRPS_KAFKA_BOOTSTRAP``), S shard servers, the HTTP API
(``ctrps serve``), W workers in one consumer group and, optionally, a
synthetic producer — each a child process of this one (`app.supervisor`),
started in that order, each waited for before the next that needs it:

- broker: answers metadata and lists the click and dead-letter topics;
- shards: ``GET /healthz`` answers 200;
- API: ``GET /readyz`` answers 200;
- workers and producer: started (they wait for the group and the topic).

The exports go to a directory of this run's own,
``<exports-dir>/cluster-<time>-<random>`` (a broker started here is new: the
run never resumes an older export), or on an outside Kafka to
``--exports-dir`` itself; either is claimed as this cluster's before any
child starts (`own_exports`, `ps_core.checkpoint.owner`).

An answer counts only from the process started: the socket listening on the
probed port must belong to that child (or, for the broker, to its binary),
read from ``/proc`` (`app.listeners`), so a process left over from another
run cannot make a role look ready. A role that cannot listen because another
process holds its port fails the start-up with one line naming the port and
that process (`PortTaken`, exit 1); a ``--port`` taken before anything starts
is refused at once, the same way.

Each child gets only the credentials its role uses, in its environment
(never its arguments, which ``ps`` shows), from a cluster secret made for
this run (`ps_core.net.auth.new_secret`) unless ``CTRPS_CLUSTER_SECRET`` (or
``_FILE``) gives one: the shards the secret; the workers a train-scope
``CTRPS_SHARD_TOKEN``; the API an admin-scope one (its admin routes export
through shard 0) and ``CTRPS_ADMIN_TOKEN``: this process's, else one made for
this run (`generated_admin_token`: a 0600 file named in the ``ready`` line,
the token printed once on stdout in text mode); the broker and the producer
none of them (`ChildCredentials`). Logs say whether the secret and the admin
token were made or given, never either.

Every child's output is copied with its role on each line. Once running, a
child that exits on its own (a crash, SIGKILL, a worker that gave up) is
started again on the same ports with the same arguments, after a doubling
backoff (``--restart-backoff``, ``--restart-backoff-max``); a child restarted
more than ``--max-restarts`` times within ``--restart-window`` stops the
cluster. Ctrl-C/SIGTERM, the end of ``--duration``, or a child that keeps
failing (or fails while the cluster starts) stops them all in reverse start
order (producer, workers, API, shards, broker): SIGTERM, then SIGKILL after a
grace period. Exit status 0 when everything started and stopped cleanly, 1
when a child kept failing or had to be killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import BinaryIO

import aiohttp
from aiokafka.admin import AIOKafkaAdminClient

from consumers.broker import _port_is_free, create_topics, free_port, wait_for_metadata
from consumers.kafka_security import KafkaSecurity
from consumers.resume import cluster_id
from ps_core.checkpoint.export_files import list_versions
from ps_core.checkpoint.owner import claim_exports, run_exports_dir, stream_owner
from ps_core.checkpoint.stream import StreamIdentity
from ps_core.waits import cancelled

from .child_credentials import ChildCredentials
from .commands.kafka_flags import kafka_child_argv, kafka_child_env
from .config.cluster import WORKER_FLAGS, ClusterSettings
from .config.declared import SettingsError, to_argv
from .config.shard import ShardSettings
from .config.worker import WorkerSettings
from .failures import ExpectedFailure
from .listeners import is_descendant, listener_pids, port_taken_by
from .logs import log_event
from .security import GeneratedToken, generated_admin_token
from .signals import stop_on_signals
from .supervisor import Child, ChildFailed, ChildSpec, RestartPolicy, Supervisor

__all__ = [
    "run_cluster",
    "TOPIC",
    "PRODUCER_EVENTS",
    "PortTaken",
    "served_by",
    "wait_served",
    "own_exports",
]

log = logging.getLogger("ctrps.cluster")

TOPIC = "clicks"
"""The click topic (its dead letters go to ``clicks.dlq``)."""

PRODUCER_EVENTS = 10**12
"""Events the producer is asked for: unbounded in practice (16 years at 2,000/s)."""

HOST = "127.0.0.1"

SHARD_STATS_INTERVAL_S = 10.0
"""Seconds between the shards' table lines: often enough to watch a table
grow, rare enough not to drown the workers' window lines."""


def broker_processes(port: int) -> list[int]:
    """Pids of broker binaries listening on `port` of 127.0.0.1 (read from /proc).

    The broker role starts its binary in a session of its own, so a SIGKILLed
    role leaves it running, holding the port; this finds it by its listener
    URL, which names the cluster's own port."""
    needle = f"--listener-url\0tcp://{HOST}:{port}\0".encode()
    pids = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                        cmdline = f.read()
                except OSError:
                    continue
                if needle in cmdline:
                    pids.append(int(entry.name))
    return pids


async def end_broker_processes(port: int, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every broker binary on `port` and wait (bounded) until each is gone."""
    pids = broker_processes(port)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(_alive(pid) for pid in pids) and loop.time() < deadline:
        await asyncio.sleep(0.05)  # poll interval: init reaps the orphan
    if pids:
        log.warning(
            "ended a broker left running by its role",
            extra={"fields": {"pids": ",".join(map(str, pids)), "port": port}},
        )
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(HOST)
        if port not in ports:
            ports.append(port)
    return ports


def worker_argv(settings: ClusterSettings, bootstrap: str, shard_urls: list[str]) -> tuple[str, ...]:
    """``worker`` and the flags each of the cluster's workers is started with."""
    return ("worker", *to_argv(settings.worker_settings(bootstrap, shard_urls, TOPIC), WORKER_FLAGS))


def _ctrps(*args: str) -> tuple[str, ...]:
    """A ``ctrps`` command run by this same Python (same venv, same code)."""
    return (sys.executable, "-m", "app.cli", *args)


class PortTaken(ExpectedFailure):
    """A role's port is held by a process the cluster did not start (exit 1)."""


async def served_by(child: Child, port: int, probe: Callable[[], Awaitable[bool]]) -> bool:
    """`probe` answered, and by `child`: a socket listening on `port` is held
    by it or by a process it started (the broker role's binary). Where
    ``/proc`` does not tell, the probe's answer is all there is."""
    if not await probe():
        return False
    holders = listener_pids(port)
    return holders is None or any(is_descendant(pid, child.pid) for pid in holders)


async def wait_served(
    sup: Supervisor, child: Child, port: int, probe: Callable[[], Awaitable[bool]], timeout_s: float
) -> None:
    """Wait until `probe` is answered on `port` by `child` (`served_by`);
    `PortTaken` naming the holder when `child` fails (or is not ready in
    time) while another process listens there, else `ChildFailed`."""
    try:
        await sup.wait_ready(child, partial(served_by, child, port, probe), timeout_s)
    except ChildFailed:
        holders = listener_pids(port)
        if holders and not any(is_descendant(pid, child.pid) for pid in holders):
            raise PortTaken(f"{child.role} cannot listen: {port_taken_by(port, HOST)}") from None
        raise


async def _http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
        return resp.status == 200


async def _topics_listed(bootstrap: str, topics: set[str], security: KafkaSecurity = KafkaSecurity()) -> bool:
    # Metadata first: it waits for the port quietly, a Kafka client would log errors.
    await wait_for_metadata(bootstrap, timeout_s=2.0, security=security)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000, **security.client_kwargs())
    try:
        await admin.start()
        return topics <= set(await admin.list_topics())
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


class _Cluster:
    """The composition: which children, with which flags, in which order."""

    def __init__(
        self,
        settings: ClusterSettings,
        sup: Supervisor,
        session: aiohttp.ClientSession,
        credentials: ChildCredentials,
        env: Mapping[str, str],
        kafka: KafkaSecurity = KafkaSecurity(),
        exports_owner: str = "",
    ):
        self.s = settings
        self.exports_owner = exports_owner
        """Who shard 0 claims the exports directory as (`own_exports`)."""
        self.credentials = credentials
        self.base_env = dict(env)
        """What every child inherits, less the credentials (`ChildCredentials`)."""
        self.kafka = kafka
        """How the cluster and the children that talk to Kafka (workers, producer) reach it."""
        self.sup = sup
        self.session = session
        self.bootstrap = settings.bootstrap
        self.shard_urls: list[str] = []
        self.api_url = ""
        self.broker_port = 0
        """The port of the broker process this cluster started (0: none)."""
        self.broker_metrics_url = ""
        """Where that broker's memory gauges are served ("": no broker started here)."""
        # Every role is restarted when it fails, unless restarts are off.
        self.restart = settings.max_restarts > 0
        self.model_dir = (
            Path(settings.exports_dir) / (os.environ.get("CTRPS_MODEL_NAME") or ShardSettings.model_name)
            if settings.exports_dir
            else None
        )
        self.newest_at_start = self._newest_version()

    def _newest_version(self) -> int:
        if self.model_dir is None or not self.model_dir.is_dir():
            return 0
        versions = list_versions(self.model_dir)
        return versions[-1].version if versions else 0

    def _shard_restart_argv(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        """A restarted shard restores what this cluster exported: without
        ``--no-restore`` once a version newer than those at start is on disk
        (an older one holds offsets of another broker); as first started
        otherwise."""
        if "--no-restore" in argv and self._newest_version() > self.newest_at_start:
            return tuple(a for a in argv if a != "--no-restore")
        return argv

    def env(self, kind: str) -> dict[str, str]:
        """The environment of a child of `kind`: its shard-plane credentials,
        and the Kafka SASL password for the workers and the producer only."""
        env = self.credentials.env_for(kind, self.base_env)
        return kafka_child_env(self.kafka, talks_to_kafka=kind in ("worker", "producer"), env=env)

    async def _start(self, spec: ChildSpec, port: int = 0, probe: Callable[[], Awaitable[bool]] | None = None) -> Child:
        child = await self.sup.start(spec)
        if probe is not None:
            await self._ready(child, port, probe)
        return child

    async def _ready(self, child: Child, port: int, probe: Callable[[], Awaitable[bool]]) -> None:
        await wait_served(self.sup, child, port, probe, self.s.ready_timeout_s)

    async def start(self) -> None:
        """Start every role, each ready before the roles that need it."""
        await self._start_broker()
        await self._start_shards()
        s, fmt = self.s, self.s.log_format
        api_port = s.port or free_port(HOST)
        self.api_url = f"http://{HOST}:{api_port}"
        await self._start(
            ChildSpec(
                "api",
                _ctrps("serve", "--host", HOST, "--port", str(api_port),
                       "--shards", ",".join(self.shard_urls), "--log-format", fmt),
                restart=self.restart,
                env=self.env("api"),
            ),
            api_port,
            partial(_http_ok, self.session, self.api_url + "/readyz"),
        )  # fmt: skip

        for j in range(s.workers):
            await self._start(
                ChildSpec(
                    f"worker-{j}",
                    _ctrps(*worker_argv(s, self.bootstrap, self.shard_urls),
                           *kafka_child_argv(self.kafka)),
                    group="workers",
                    restart=self.restart,
                    env=self.env("worker"),
                )
            )  # fmt: skip

        if s.produce_rate > 0:
            await self._start(
                ChildSpec(
                    "producer",
                    _ctrps("produce", "synthetic", "--bootstrap", self.bootstrap,
                           "--topic", TOPIC, "--partitions", str(s.partitions),
                           "--events", str(PRODUCER_EVENTS), "--rate", str(s.produce_rate),
                           "--log-format", fmt, *kafka_child_argv(self.kafka)),
                    may_finish=True,
                    restart=self.restart,
                    env=self.env("producer"),
                )
            )  # fmt: skip

    async def _start_broker(self) -> None:
        """The topics on the given Kafka, or a broker process with them."""
        s, fmt = self.s, self.s.log_format
        topics = {TOPIC: s.partitions, f"{TOPIC}.dlq": 1}
        if self.bootstrap:
            await wait_for_metadata(self.bootstrap, timeout_s=s.ready_timeout_s, security=self.kafka)
            await create_topics(self.bootstrap, topics, security=self.kafka)
        else:
            port = self.broker_port = free_port(HOST)
            self.bootstrap = f"{HOST}:{port}"
            # The broker's memory grows with every record (no retention): its
            # gauges are served on a port of their own, named in `ready`.
            metrics_port = free_port(HOST)
            self.broker_metrics_url = f"http://{HOST}:{metrics_port}/metrics"
            await self._start(
                ChildSpec(
                    "broker",
                    _ctrps("broker", "--port", str(port), "--log-format", fmt, "--metrics-port", str(metrics_port),
                           *(a for t, n in topics.items() for a in ("--topic", f"{t}:{n}"))),
                    restart=self.restart,
                    env=self.env("broker"),
                    # A SIGKILLed role leaves its binary holding the port.
                    before_restart=partial(end_broker_processes, port),
                ),
                port,
                partial(_topics_listed, self.bootstrap, set(topics)),
            )  # fmt: skip

    async def _start_shards(self) -> None:
        """The shard processes, started together, each ready."""
        s, fmt = self.s, self.s.log_format
        shards = []
        ports = _free_ports(2 * s.shards)  # HTTP and RPC
        self.shard_urls = [f"http://{HOST}:{p}" for p in ports[: s.shards]]
        if s.exports_dir:
            # Shard 0 hosts the coordinator and exports; it reaches the others
            # by these URLs. A broker started here is new, so an older
            # export's offsets mean nothing to it: restore only from Kafka
            # the cluster did not start.
            exports = [
                "--shards",
                ",".join(self.shard_urls),
                "--exports-dir",
                s.exports_dir,
                "--export-interval",
                str(s.export_interval_s),
                "--exports-mode",
                f"{s.exports_mode:04o}",
                "--exports-owner",
                self.exports_owner,
            ]
            if not s.bootstrap:
                exports.append("--no-restore")
        else:
            exports = ["--no-exports"]
        for i, url in enumerate(self.shard_urls):
            # The RPC port is fixed too: a restarted shard comes back where
            # the workers' and the API's clients know it.
            argv = _ctrps("shard", "--host", HOST, "--port", url.rsplit(":", 1)[1],
                          "--rpc-port", str(ports[s.shards + i]), "--shard-id", str(i),
                          "--num-shards", str(s.shards), "--stats-interval", str(SHARD_STATS_INTERVAL_S),
                          "--log-format", fmt, *exports)  # fmt: skip
            spec = ChildSpec(
                f"shard-{i}", argv, group="shards", restart=self.restart, env=self.env("shard"),
                restart_argv=partial(self._shard_restart_argv, argv),
            )  # fmt: skip
            shards.append(await self.sup.start(spec))
        # Shards start together: their interpreters load in parallel.
        await asyncio.gather(
            *(
                self._ready(c, p, partial(_http_ok, self.session, u + "/healthz"))
                for c, p, u in zip(shards, ports, self.shard_urls)
            )
        )


async def own_exports(
    settings: ClusterSettings, env: Mapping[str, str], kafka: KafkaSecurity = KafkaSecurity()
) -> tuple[str, str]:
    """The cluster's exports directory and the owner it claims it as
    (`ps_core.checkpoint.owner`), claimed before any child starts; ``("", "")``
    without exports.

    With the broker process it starts, the run never resumes an older
    export (the broker is new): a directory of the run's own,
    ``<exports-dir>/cluster-<time>-<random>``, owned by the run. On an
    outside Kafka it resumes from ``--exports-dir`` itself, owned by its
    stream (that Kafka's cluster id and the workers' group), so its next
    run resumes there and another cluster's is refused (`ExportsOwnedError`,
    exit 4) unless ``--take-over-exports``."""
    if not settings.exports_dir:
        return "", ""
    if not settings.bootstrap:
        path = await asyncio.to_thread(run_exports_dir, Path(settings.exports_dir), "cluster")
        owner = path.name
    else:
        await wait_for_metadata(settings.bootstrap, timeout_s=settings.ready_timeout_s, security=kafka)
        kafka_id = await cluster_id(settings.bootstrap, security=kafka)
        path = Path(settings.exports_dir)
        owner = stream_owner(StreamIdentity(kafka_id, env.get("CTRPS_GROUP") or WorkerSettings.group))
    record, took_over = await asyncio.to_thread(
        claim_exports,
        path,
        owner,
        "ctrps cluster",
        take_over=settings.take_over_exports,
        file_mode=settings.exports_mode,
    )
    if took_over:
        log.warning(
            "took over the exports directory",
            extra={"fields": {"exports": str(path), "owner": owner, "taken_from": record.taken_from}},
        )
    return str(path), owner


async def run_cluster(
    settings: ClusterSettings,
    stop: asyncio.Event | None = None,
    out: BinaryIO | None = None,
    env: Mapping[str, str] | None = None,
    *,
    kafka: KafkaSecurity = KafkaSecurity(),
) -> int:
    """Run the cluster until SIGTERM/SIGINT, `stop`, ``duration_s`` or a
    child's failure; returns the exit status (0 clean, 1 a child failed).
    The children inherit `env` (default: this process's environment) less
    its credentials, plus their own (`ChildCredentials`); `SettingsError`
    for an unusable given secret, before anything starts.

    `kafka` is how the cluster, its workers and its producer reach the Kafka
    at ``settings.bootstrap`` (the broker process it starts otherwise speaks
    PLAINTEXT only: other settings need a bootstrap, `SettingsError`). The
    workers and the producer get it as flags and the SASL password in their
    environment; no other child gets the password."""
    _check_startable(settings, kafka)
    env = os.environ if env is None else env
    credentials = ChildCredentials.from_env(env)
    exports_dir, exports_owner = await own_exports(settings, env, kafka)
    settings = replace(settings, exports_dir=exports_dir)
    stop = stop or asyncio.Event()
    sup = _supervisor(settings, out)
    loop = asyncio.get_running_loop()
    failed = False
    timer: asyncio.TimerHandle | None = None
    with stop_on_signals(stop), contextlib.ExitStack() as files:
        generated = None
        if not credentials.admin_token:
            # The API's admin routes are never open: a token for this run.
            generated = files.enter_context(generated_admin_token("cluster"))
            credentials = replace(credentials, admin_token=generated.token)
        async with aiohttp.ClientSession() as session:
            cluster = _Cluster(settings, sup, session, credentials, env, kafka, exports_owner)
            starting = asyncio.create_task(cluster.start())
            waiting = asyncio.create_task(sup.wait(stop))
            try:
                # A signal or a failed child during start-up aborts it; the
                # children started so far are stopped below.
                await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
                if not starting.done():
                    starting.cancel()
                try:
                    await starting
                except asyncio.CancelledError:
                    log_event(log, "start-up interrupted")
                else:
                    _announce_ready(cluster, sup, credentials, generated)
                    if settings.duration_s > 0:
                        timer = loop.call_later(settings.duration_s, stop.set)
                    await waiting
            except Exception as exc:  # ChildFailed, an unreachable external broker, ...
                failed = True
                log.error("start-up failed", extra={"fields": {"error": str(exc)}})
            finally:
                if timer is not None:
                    timer.cancel()
                await cancelled(waiting)
                await sup.stop_all()
                if cluster.broker_port:
                    # Nothing may outlive the cluster, not even a killed role's broker.
                    await end_broker_processes(cluster.broker_port)
    _log_stopped(sup)
    return 1 if failed else sup.exit_status()


def _check_startable(settings: ClusterSettings, kafka: KafkaSecurity) -> None:
    """`SettingsError` or `PortTaken` for a cluster that could not start, before anything starts."""
    if kafka.security_protocol != "PLAINTEXT" and not settings.bootstrap:
        raise SettingsError(
            f"Kafka security protocol {kafka.security_protocol} needs --bootstrap: "
            "the broker process the cluster starts speaks PLAINTEXT only"
        )
    if settings.port and not _port_is_free(HOST, settings.port):
        # Before anything starts: the API could not listen, and a probe of
        # that port would be answered by the other process.
        raise PortTaken(f"the API cannot listen: {port_taken_by(settings.port, HOST)}")


def _supervisor(settings: ClusterSettings, out: BinaryIO | None) -> Supervisor:
    policy = RestartPolicy(
        backoff_s=settings.restart_backoff_s,
        max_backoff_s=settings.restart_backoff_max_s,
        max_restarts=settings.max_restarts,
        window_s=settings.restart_window_s,
    )
    return Supervisor(out=out, fmt=settings.log_format, grace_s=settings.grace_s, restart=policy)


def _announce_ready(
    cluster: _Cluster, sup: Supervisor, credentials: ChildCredentials, generated: GeneratedToken | None
) -> None:
    """The "ready" line: where each part listens, whether secrets were generated (never what)."""
    log_event(
        log,
        "ready",
        api=cluster.api_url,
        shards=",".join(cluster.shard_urls),
        bootstrap=cluster.bootstrap,
        broker_metrics=cluster.broker_metrics_url or "-",
        exports=cluster.s.exports_dir or "-",
        # Whether, never what: no secret or token is logged.
        auth="on",
        cluster_secret="generated" if credentials.generated else "given",
        admin_token="generated" if generated is not None else "given",
        admin_token_file=str(generated.path) if generated is not None else "-",
        pids=",".join(f"{c.role}={c.pid}" for c in sup.children),
    )
    if generated is not None and cluster.s.log_format == "text":
        # Once, on the output a person reads, never in a log line.
        sup.out.write(f"[cluster] admin token of this run (also in {generated.path}): {generated.token}\n".encode())
        sup.out.flush()


def _log_stopped(sup: Supervisor) -> None:
    """Why the cluster stopped: a failed child, children that did not stop cleanly, the counts."""
    unclean = sup.unclean
    if sup.failed is not None:
        log.error(
            "stopped because a child failed",
            extra={"fields": {"role": sup.failed.role, "reason": sup.failed.failure}},
        )
    if unclean:
        log.error(
            "children did not stop cleanly",
            extra={"fields": {"roles": ",".join(f"{c.role}={c.returncode}" for c in unclean)}},
        )
    log_event(log, "stopped", children=len(sup.children), restarts=sup.restarts)
