"""A commit the worker gave up on that fails later in aiokafka is one warning
line and a count, not "Task exception was never retrieved" with a traceback
(`consumers.late_commits`). Built with a real broker of the test's own:
frozen (SIGSTOP) while a commit is in flight, so the worker's bound gives up
on it, then killed, so aiokafka's shielded request fails with nobody
waiting for it."""

from __future__ import annotations

import gc
import logging
import os
import signal

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from waiting import until

from consumers.broker import EmbeddedBroker, free_port
from consumers.late_commits import late_commits_reported
from consumers.outage_watch import stop_client
from consumers.reports import WorkerStats
from ps_core.waits import within

pytestmark = [
    pytest.mark.slow,
    pytest.mark.process,
    pytest.mark.kafka,
    pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use"),
]


async def test_a_commit_given_up_on_that_fails_later_is_one_line_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = EmbeddedBroker(port=free_port())
    await broker.start()
    consumer: AIOKafkaConsumer | None = None
    try:
        await broker.create_topics({"late": 1})
        tp = TopicPartition("late", 0)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=broker.bootstrap, group_id="late-g", enable_auto_commit=False, request_timeout_ms=60_000
        )
        await within(consumer.start(), 30)
        consumer.assign([tp])
        await within(consumer.commit({tp: 0}), 30)  # the group coordinator known and answering
        stats = WorkerStats()
        with caplog.at_level(logging.WARNING), late_commits_reported(stats):
            os.kill(broker.pid, signal.SIGSTOP)
            with pytest.raises(TimeoutError):  # the worker's bound on a commit, short here
                await within(consumer.commit({tp: 1}), 0.5)
            os.kill(broker.pid, signal.SIGKILL)  # the shielded request's connection closes under it

            def counted() -> bool:
                gc.collect()  # the failed task is reported when it is collected
                return stats.late_commit_failures == 1

            await until(counted, 30, what="the late failure reported")
        lines = [r for r in caplog.records if r.name == "ctrps.worker"]
        assert [r.getMessage() for r in lines] == [
            "a commit given up on failed later: its window was already trained again"
        ]
        assert "Error" in lines[0].__dict__["fields"]["error"], lines[0].__dict__
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    finally:
        if consumer is not None:
            await stop_client(consumer)
        broker.stop()
