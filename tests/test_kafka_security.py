"""Kafka security: the settings, their flags, and every Kafka client ctrps
builds using them.

The embedded broker speaks PLAINTEXT only (see `kafka_front`): PLAINTEXT set
explicitly runs against it; TLS, mutual TLS and SASL PLAIN run end to end
through `KafkaFront`, a TLS and SASL front of a broker of its own that refuses
any request before a login, so a client built without the settings fails.
SCRAM reaches the client objects (checked on them) and the wire (the front
refuses it by name)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import trustme
from aiokafka import TopicPartition
from jsonlog import read_json_lines
from kafka_front import KafkaFront
from waiting import until

import app.cluster
import consumers.broker
import consumers.outage
import consumers.producer
import consumers.resume
import consumers.worker
from app.commands.kafka_flags import add_kafka_security_flags, kafka_child_argv, kafka_child_env, kafka_security_from
from app.config.declared import SettingsError
from consumers.broker import create_topics, wait_for_metadata
from consumers.kafka_security import KafkaAccessError, KafkaSecurity, KafkaSecurityError, check_access
from consumers.outage import locate_bad_batch
from consumers.producer import produce
from consumers.resume import cluster_id, partition_bounds
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

PASSWORD = "pw-Zq81-never-shown"


class Pki:
    """A CA, a broker certificate for 127.0.0.1 and a client certificate, as files."""

    def __init__(self, root: Path, hosts: tuple[str, ...] = ("127.0.0.1",)) -> None:
        self.ca = trustme.CA()
        self.server = self.ca.issue_cert(*hosts)
        client = self.ca.issue_cert("ctrps-client")
        root.mkdir(parents=True, exist_ok=True)
        self.ca_file, self.cert_file, self.key_file = root / "ca.pem", root / "client.pem", root / "client.key"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        client.cert_chain_pems[0].write_to_path(str(self.cert_file))
        client.private_key_pem.write_to_path(str(self.key_file))

    def server_context(self, *, client_certs: bool) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server.configure_cert(ctx)
        if client_certs:
            self.ca.configure_trust(ctx)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def security(self, protocol: str = "SASL_SSL", **kw: Any) -> KafkaSecurity:
        base: dict[str, Any] = dict(ssl_ca=str(self.ca_file), ssl_cert=str(self.cert_file), ssl_key=str(self.key_file))
        if protocol.startswith("SASL_"):
            base.update(sasl_username="alice", sasl_password=PASSWORD)
        base.update(kw)
        return KafkaSecurity(protocol, **base)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def _topic() -> str:
    return f"sec-{uuid.uuid4().hex[:10]}"


def _event(i: int) -> dict[str, Any]:
    return {"id": f"e{i}", "ts": 1_764_681_600 + i, "label": i % 3 == 0 and 1 or 0,
            "features": {"site": f"s{i % 5}", "ad": f"a{i % 7}"}}  # fmt: skip


# -- the settings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"security_protocol": "TLS"}, "Kafka security protocol 'TLS' is not one of PLAINTEXT, SSL, SASL_PLAINTEXT"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "GSSAPI", "sasl_username": "a", "sasl_password": "p"},
         "SASL mechanism 'GSSAPI' is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_password": "p"}, "needs a username (--kafka-sasl-username"),
        ({"security_protocol": "SASL_SSL", "sasl_username": "a"}, "needs a password (CTRPS_KAFKA_SASL_PASSWORD"),
        ({"security_protocol": "SASL_SSL"}, "needs a username (--kafka-sasl-username or CTRPS_KAFKA_SASL_USERNAME) and a password"),
        ({"sasl_username": "a"}, "SASL username or password is set but the security protocol is PLAINTEXT"),
        ({"ssl_ca": "/etc/hostname"}, "--kafka-ssl-ca set but the Kafka security protocol is PLAINTEXT"),
        ({"security_protocol": "SSL", "ssl_ca": "/no/such/ca.pem"}, "--kafka-ssl-ca '/no/such/ca.pem': no such file"),
        ({"security_protocol": "SSL", "ssl_cert": "/etc/hostname"}, "--kafka-ssl-cert and --kafka-ssl-key go together"),
        ({"security_protocol": "SSL", "ssl_ca": "/etc/hostname"}, "Kafka TLS files do not load"),
    ],
)  # fmt: skip
def test_unusable_settings_are_one_clear_line(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(KafkaSecurityError) as err:
        KafkaSecurity(**kwargs)
    assert says in str(err.value)
    assert "\n" not in str(err.value)
    assert type(err.value).exit_code == 2


def test_client_kwargs_are_what_aiokafka_takes(pki: Pki) -> None:
    assert KafkaSecurity().client_kwargs() == {"security_protocol": "PLAINTEXT"}
    sec = pki.security("SASL_SSL", sasl_mechanism="SCRAM-SHA-512")
    kw = sec.client_kwargs()
    assert kw == {
        "security_protocol": "SASL_SSL", "ssl_context": sec.ssl_context, "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice", "sasl_plain_password": PASSWORD,
    }  # fmt: skip
    ctx = sec.ssl_context
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert sec.ssl_context is ctx  # one context, shared by every client
    assert KafkaSecurity("SSL", ssl_check_hostname=False).ssl_context.check_hostname is False  # type: ignore[union-attr]
    # No CA: the system's (a managed Kafka's public CA), still verified.
    assert KafkaSecurity("SSL").ssl_context.verify_mode == ssl.CERT_REQUIRED  # type: ignore[union-attr]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_kafka_security_flags(p)
    return p


def test_flags_over_environment_and_the_password_from_the_environment_only(pki: Pki, tmp_path: Path) -> None:
    env = {"CTRPS_KAFKA_SECURITY_PROTOCOL": "sasl_plaintext", "CTRPS_KAFKA_SASL_USERNAME": "bob",
           "CTRPS_KAFKA_SASL_MECHANISM": "scram-sha-256", "CTRPS_KAFKA_SASL_PASSWORD": PASSWORD}  # fmt: skip
    sec = kafka_security_from(_parser().parse_args([]), env)
    assert (sec.security_protocol, sec.sasl_mechanism, sec.sasl_username, sec.sasl_password) == (
        "SASL_PLAINTEXT", "SCRAM-SHA-256", "bob", PASSWORD,
    )  # fmt: skip
    args = _parser().parse_args(["--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-username", "alice",
                                 "--kafka-ssl-ca", str(pki.ca_file), "--kafka-ssl-no-check-hostname"])  # fmt: skip
    sec = kafka_security_from(args, env)
    assert (sec.security_protocol, sec.sasl_username, sec.ssl_ca, sec.ssl_check_hostname) == (
        "SASL_SSL", "alice", str(pki.ca_file), False,
    )  # fmt: skip
    secret = tmp_path / "kafka-password"
    secret.write_text(PASSWORD + "\n")
    file_env = {**env, "CTRPS_KAFKA_SASL_PASSWORD": "", "CTRPS_KAFKA_SASL_PASSWORD_FILE": str(secret)}
    assert kafka_security_from(None, file_env).sasl_password == PASSWORD
    with pytest.raises(SettingsError, match="CTRPS_KAFKA_SASL_PASSWORD or CTRPS_KAFKA_SASL_PASSWORD_FILE, not both"):
        kafka_security_from(None, {**file_env, "CTRPS_KAFKA_SASL_PASSWORD": PASSWORD})
    with pytest.raises(SettingsError, match="CTRPS_KAFKA_SSL_CHECK_HOSTNAME='maybe'"):
        kafka_security_from(None, {"CTRPS_KAFKA_SSL_CHECK_HOSTNAME": "maybe"})
    # There is no password flag: argparse refuses it.
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kafka-sasl-password", PASSWORD])


def test_the_password_is_never_shown(pki: Pki) -> None:
    sec = pki.security("SASL_SSL")
    config = WorkerConfig("127.0.0.1:9092", kafka=sec)
    assert "sasl_username='alice'" in repr(sec)
    for text in (repr(sec), str(sec), repr(config), str(sec.fields()), " ".join(kafka_child_argv(sec))):
        assert PASSWORD not in text


def test_a_composition_hands_the_password_to_its_kafka_children_only(pki: Pki) -> None:
    sec = pki.security("SASL_SSL", sasl_mechanism="SCRAM-SHA-256", ssl_check_hostname=False)
    argv = kafka_child_argv(sec)
    assert argv == [
        "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-mechanism", "SCRAM-SHA-256",
        "--kafka-sasl-username", "alice", "--kafka-ssl-ca", str(pki.ca_file),
        "--kafka-ssl-cert", str(pki.cert_file), "--kafka-ssl-key", str(pki.key_file), "--kafka-ssl-no-check-hostname",
    ]  # fmt: skip
    # The child rebuilds the same settings from those flags and its environment.
    env = {"PATH": "/bin", "CTRPS_KAFKA_SASL_PASSWORD_FILE": "/run/secrets/kafka"}
    child_env = kafka_child_env(sec, talks_to_kafka=True, env=env)
    assert child_env == {"PATH": "/bin", "CTRPS_KAFKA_SASL_PASSWORD": PASSWORD}
    assert kafka_security_from(_parser().parse_args(argv), child_env) == sec
    assert kafka_child_env(sec, talks_to_kafka=False, env={**env, "CTRPS_KAFKA_SASL_PASSWORD": PASSWORD}) == {
        "PATH": "/bin"
    }
    assert kafka_child_argv(KafkaSecurity()) == []


def _ctrps_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    env.update(extra)
    return env


async def _ctrps(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", *argv, env=env or _ctrps_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


@pytest.mark.slow
@pytest.mark.process
async def test_the_commands_refuse_unusable_settings_with_exit_2_and_one_line(pki: Pki) -> None:
    runs = [
        (["worker", "--bootstrap", "127.0.0.1:9", "--shards", "http://127.0.0.1:9",
          "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-username", "alice"], "needs a password"),
        (["produce", "synthetic", "--bootstrap", "127.0.0.1:9", "--kafka-security-protocol", "SSL",
          "--kafka-ssl-ca", "/no/such/ca.pem"], "--kafka-ssl-ca '/no/such/ca.pem': no such file"),
        (["demo", "--kafka-security-protocol", "SSL"], "needs --bootstrap: the embedded broker speaks PLAINTEXT only"),
        (["cluster", "--kafka-sasl-mechanism", "OAUTHBEARER"], "SASL mechanism 'OAUTHBEARER' is not one of"),
    ]  # fmt: skip
    results = await asyncio.gather(*(_ctrps(*argv) for argv, _ in runs))
    for (argv, says), (code, out) in zip(runs, results):
        assert code == 2, (argv, out)
        assert says in out, out
        assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out


# -- against brokers --------------------------------------------------------------


class _Recorded:
    """Every aiokafka client built at each construction site: the real classes,
    subclassed where each module names them, to see what each site passed."""

    SITES = [
        (consumers.worker, "AIOKafkaConsumer"),
        (consumers.worker, "AIOKafkaProducer"),
        (consumers.broker, "AIOKafkaAdminClient"),
        (consumers.resume, "AIOKafkaAdminClient"),
        (consumers.resume, "AIOKafkaConsumer"),
        (consumers.outage, "AIOKafkaConsumer"),
        (consumers.producer, "AIOKafkaProducer"),
        (app.cluster, "AIOKafkaAdminClient"),
    ]

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built: dict[str, list[Any]] = {}
        for module, name in self.SITES:
            site = f"{module.__name__}.{name}"
            real = getattr(module, name)
            made = self.built.setdefault(site, [])

            def init(self_: Any, *args: Any, _real: Any = real, _made: list[Any] = made, **kw: Any) -> None:
                _real.__init__(self_, *args, **kw)
                _made.append(self_)

            monkeypatch.setattr(module, name, type(name, (real,), {"__init__": init}))

    def clients(self) -> Iterator[tuple[str, Any]]:
        for site, made in self.built.items():
            for c in made:
                # The producer holds its AIOKafkaClient as `client`, the others as `_client`.
                yield site, getattr(c, "_client", None) or c.client


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.kafka
async def test_every_client_connects_with_sasl_over_mutual_tls(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SASL_SSL with a client certificate, end to end: topics, the produce
    path, the worker (consumer, dead-letter producer, cluster id, partition
    bounds), the bad-batch lookup and the cluster's topic check all log in
    through the front, which serves nothing before a login; and each built its
    client with every setting. At DEBUG, nothing logged holds the password."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="aiokafka")  # held at WARNING once a command configured logging
    recorded = _Recorded(monkeypatch)
    sec = pki.security("SASL_SSL")
    topic = _topic()
    async with KafkaFront(ssl_context=pki.server_context(client_certs=True), users={"alice": PASSWORD}) as front:
        boot = front.bootstrap
        await wait_for_metadata(boot, timeout_s=20, security=sec)
        await create_topics(boot, {topic: 2, topic + ".dlq": 1}, security=sec)
        assert await app.cluster._topics_listed(boot, {topic}, sec)
        events: list[Any] = [_event(i) for i in range(40)]
        report = await produce(boot, topic, events, security=sec)
        assert report.sent == 40
        # One record the worker dead-letters (through its own producer).
        await produce(boot, topic, [{"label": 1}], partitions=1, security=sec)

        shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
        config = WorkerConfig(boot, topic=topic, group=f"g-{uuid.uuid4().hex[:6]}", dlq_topic=topic + ".dlq",
                              window_seconds=0.3, window_events=20, decode_processes=0, kafka=sec)  # fmt: skip
        async with (
            PSClient.local(shards) as client,
            ControlClient.local(shards, Coordinator(lease_ttl_s=30.0)) as control,
        ):
            worker = Worker(config, client, control, LogisticRegression("m"))
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))
            try:
                await until(lambda: worker.stats.records >= 41 and worker.stats.commits > 0, 60,
                            what="the worker to train every record", task=task)  # fmt: skip
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)
        assert worker.stats.events_trained == 40 and worker.stats.dead_letters == 1
        assert worker.cluster_id == f"front-{boot.rsplit(':', 1)[1]}"
        tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
        assert await partition_bounds(boot, tps, security=sec) == {tps[0]: (0, 21), tps[1]: (0, 20)}
        assert await cluster_id(boot, security=sec) == worker.cluster_id
        assert await locate_bad_batch(boot, topic, 1, 0, timeout_s=1.0, security=sec) is None

    assert all(ok for _, ok in front.logins) and len(front.logins) >= 10
    assert front.refused == 0
    assert front.peer_certs and all(c is not None for c in front.peer_certs)
    for site, made in recorded.built.items():
        assert made, f"{site} built no client"
    for site, c in recorded.clients():
        assert c._security_protocol == "SASL_SSL", site
        assert (c._sasl_mechanism, c._sasl_plain_username, c._sasl_plain_password) == ("PLAIN", "alice", PASSWORD), site
        assert c._ssl_context is sec.ssl_context, site
    logged = [r.getMessage() for r in caplog.records]
    assert any("SaslAuthenticateRequest" in m for m in logged)  # the client's own DEBUG lines, redacted
    assert not [m for m in logged if PASSWORD in m]


@pytest.mark.process
@pytest.mark.kafka
async def test_scram_settings_reach_the_clients_and_the_wire(pki: Pki) -> None:
    """SCRAM-SHA-512 over TLS without a client certificate: the clients carry
    the mechanism; the front offers PLAIN only, and its refusal is one clear
    line naming the mechanism."""
    sec = pki.security("SASL_SSL", sasl_mechanism="SCRAM-SHA-512", ssl_cert="", ssl_key="")
    async with KafkaFront(ssl_context=pki.server_context(client_certs=False), users={"alice": PASSWORD}) as front:
        with pytest.raises(KafkaAccessError, match="does not offer SASL mechanism SCRAM-SHA-512"):
            await wait_for_metadata(front.bootstrap, timeout_s=20, security=sec)
    consumer = consumers.worker.AIOKafkaConsumer(bootstrap_servers="x:1", **sec.client_kwargs())
    producer = consumers.worker.AIOKafkaProducer(bootstrap_servers="x:1", **sec.client_kwargs())
    admin = consumers.broker.AIOKafkaAdminClient(bootstrap_servers="x:1", **sec.client_kwargs())
    try:
        for c in (consumer._client, producer.client, admin._client):
            assert (c._security_protocol, c._sasl_mechanism, c._sasl_plain_password) == (
                "SASL_SSL", "SCRAM-SHA-512", PASSWORD,
            )  # fmt: skip
            assert c._ssl_context is sec.ssl_context
    finally:
        await consumer.stop()
        await producer.stop()
        await admin.close()


@pytest.mark.process
@pytest.mark.kafka
async def test_refused_handshakes_and_logins_are_one_clear_error(pki: Pki, tmp_path: Path) -> None:
    other = Pki(tmp_path / "other")
    async with KafkaFront(ssl_context=pki.server_context(client_certs=True), users={"alice": PASSWORD}) as front:
        boot = front.bootstrap
        cases = [
            # A broker certificate signed by another CA: the handshake verifies it, and fails.
            (pki.security("SSL", ssl_ca=str(other.ca_file)), "TLS handshake with the Kafka broker at"),
            (pki.security(ssl_ca=str(other.ca_file)), "certificate verify failed"),
            # No client certificate for a broker that requires one.
            (pki.security(ssl_cert="", ssl_key=""), "closed the connection (does it require a client certificate"),
            (pki.security(sasl_password="wrong-" + PASSWORD), "SASL authentication as 'alice' (PLAIN)"),
            (pki.security(sasl_username="mallory"), "SASL authentication as 'mallory' (PLAIN)"),
            # Plain text to a TLS port.
            (KafkaSecurity("SASL_PLAINTEXT", sasl_username="alice", sasl_password=PASSWORD), "does it expect TLS"),
        ]
        for sec, says in cases:
            with pytest.raises(KafkaAccessError) as err:
                await wait_for_metadata(boot, timeout_s=20, security=sec)
            text = str(err.value)
            assert says in text and "\n" not in text, text
            assert PASSWORD not in text
        assert ("mallory", False) in front.logins and ("alice", False) in front.logins
        await check_access(boot, pki.security())  # the right settings pass


@pytest.mark.process
@pytest.mark.kafka
async def test_the_host_name_is_checked_unless_turned_off(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki", hosts=("broker.example",))
    async with KafkaFront(ssl_context=pki.server_context(client_certs=False)) as front:
        with pytest.raises(KafkaAccessError, match="does not name this host"):
            await check_access(front.bootstrap, pki.security("SSL"))
        loose = pki.security("SSL", ssl_check_hostname=False)
        await wait_for_metadata(front.bootstrap, timeout_s=20, security=loose)
        topic = _topic()
        await create_topics(front.bootstrap, {topic: 1}, security=loose)
        assert (await produce(front.bootstrap, topic, [_event(i) for i in range(5)], security=loose)).sent == 5


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.kafka
async def test_the_produce_command_over_sasl_ssl_and_its_refusal(pki: Pki) -> None:
    """`ctrps produce` with the flags and the password in its environment;
    with a wrong password, exit 1 and one line that does not hold it."""
    async with KafkaFront(ssl_context=pki.server_context(client_certs=True), users={"alice": PASSWORD}) as front:
        flags = ["--bootstrap", front.bootstrap, "--topic", _topic(), "--partitions", "1",
                 "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-username", "alice",
                 "--kafka-ssl-ca", str(pki.ca_file), "--kafka-ssl-cert", str(pki.cert_file),
                 "--kafka-ssl-key", str(pki.key_file)]  # fmt: skip
        (ok, out), (bad, bad_out) = await asyncio.gather(
            _ctrps("produce", "synthetic", "--events", "50", "--log-format", "json", *flags,
                   env=_ctrps_env(CTRPS_KAFKA_SASL_PASSWORD=PASSWORD)),
            _ctrps("produce", "synthetic", "--events", "50", *flags,
                   env=_ctrps_env(CTRPS_KAFKA_SASL_PASSWORD="wrong-" + PASSWORD)),
        )  # fmt: skip
    assert ok == 0, out
    done = [orjson.loads(line) for line in out.splitlines() if '"done"' in line]
    assert done and done[0]["sent"] == 50
    assert PASSWORD not in out
    assert bad == 1, bad_out
    assert "SASL authentication as 'alice' (PLAIN)" in bad_out and "Traceback" not in bad_out
    assert len(bad_out.strip().splitlines()) == 1, bad_out
    assert PASSWORD not in bad_out


@pytest.mark.slow
@pytest.mark.process
async def test_plaintext_set_explicitly_works_against_the_embedded_broker(kafka_bootstrap: str) -> None:
    sec = KafkaSecurity("PLAINTEXT")
    topic = _topic()
    await wait_for_metadata(kafka_bootstrap, security=sec)
    await create_topics(kafka_bootstrap, {topic: 1, topic + ".dlq": 1}, security=sec)
    code, out = await _ctrps(
        "produce", "synthetic", "--events", "30", "--bootstrap", kafka_bootstrap, "--topic", topic,
        "--kafka-security-protocol", "PLAINTEXT",
    )  # fmt: skip
    assert code == 0, out
    config = WorkerConfig(kafka_bootstrap, topic=topic, group=f"g-{uuid.uuid4().hex[:6]}", dlq_topic=topic + ".dlq",
                          window_seconds=0.3, window_events=10, decode_processes=0, kafka=sec)  # fmt: skip
    one = [Shard(ShardSpec(0, 1))]
    async with PSClient.local(one) as client, ControlClient.local(one) as control:
        worker = Worker(config, client, control, LogisticRegression("m"))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: worker.stats.events_trained >= 30, 60, what="30 events trained", task=task)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.kafka
async def test_a_cluster_over_sasl_ssl_hands_the_password_to_its_kafka_children_only(pki: Pki, tmp_path: Path) -> None:
    """`ctrps cluster --bootstrap` of a SASL_SSL Kafka with mutual TLS: its
    workers and producer log in (flags, and the password in their
    environment) and train; the shard and the API hold no password."""
    import aiohttp

    err_log, out_log = tmp_path / "cluster.log", tmp_path / "children.log"
    async with KafkaFront(ssl_context=pki.server_context(client_certs=True), users={"alice": PASSWORD}) as front:
        with out_log.open("wb") as out, err_log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.cli", "cluster", "--bootstrap", front.bootstrap,
                "--shards", "1", "--workers", "1", "--port", "0", "--produce-rate", "2000",
                "--window-seconds", "1", "--no-exports", "--duration", "120", "--log-format", "json",
                "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-username", "alice",
                "--kafka-ssl-ca", str(pki.ca_file), "--kafka-ssl-cert", str(pki.cert_file),
                "--kafka-ssl-key", str(pki.key_file),
                env={**_ctrps_env(CTRPS_KAFKA_SASL_PASSWORD=PASSWORD), "PYTHONUNBUFFERED": "1"},
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
            )  # fmt: skip
        try:

            def ready() -> dict[str, Any] | None:
                assert proc.returncode is None, err_log.read_text()[-3000:]
                lines = read_json_lines(err_log)
                return next((x for x in lines if x.get("msg") == "ready" and x.get("logger") == "ctrps.cluster"), None)

            await until(lambda: ready() is not None, 90, what="the cluster to be ready")
            info = ready()
            assert info is not None
            started = {x["role"]: x["pid"] for x in read_json_lines(err_log) if x.get("msg") == "started"}
            assert set(started) == {"shard-0", "api", "worker-0", "producer"}
            holds = {role: _environ(pid).get("CTRPS_KAFKA_SASL_PASSWORD") == PASSWORD for role, pid in started.items()}
            assert holds == {"shard-0": False, "api": False, "worker-0": True, "producer": True}
            async with aiohttp.ClientSession() as session:

                async def trained() -> bool:
                    async with session.get(info["api"] + "/v1/model") as resp:
                        return bool((await resp.json())["events_trained"] > 0)

                await until(trained, 90, what="events trained through the secured Kafka")
            proc.send_signal(signal.SIGINT)
            rc = await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
                for pid in (x["pid"] for x in read_json_lines(err_log) if x.get("msg") == "started"):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
    assert rc == 0, err_log.read_text()[-3000:]
    assert front.logins and all(ok for _, ok in front.logins) and front.refused == 0
    logged = err_log.read_text() + out_log.read_text()
    assert PASSWORD not in logged


@pytest.mark.process
@pytest.mark.kafka
async def test_a_worker_refused_by_the_broker_exits_1_with_one_line(pki: Pki, serve_shards: Any) -> None:
    """A wrong CA is not an outage to wait out: the worker stops at start."""
    _, urls = await serve_shards(1)
    other = Pki(pki.ca_file.parent.parent / "other")
    async with KafkaFront(ssl_context=pki.server_context(client_certs=False), users={"alice": PASSWORD}) as front:
        code, out = await _ctrps(
            "worker", "--bootstrap", front.bootstrap, "--shards", urls[0], "--topic", _topic(),
            "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-username", "alice",
            "--kafka-ssl-ca", str(other.ca_file),
            env=_ctrps_env(CTRPS_KAFKA_SASL_PASSWORD=PASSWORD),
        )  # fmt: skip
    assert code == 1, out
    errors = [line for line in out.splitlines() if " error " in line]
    assert len(errors) == 1 and "TLS handshake with the Kafka broker at" in errors[0], out
    assert "Traceback" not in out and PASSWORD not in out
    assert "(SASL_SSL) failed" in errors[0]  # the line says how it connects
