"""Prometheus expositions in tests: checked by ``promtool check metrics``
(skipped where promtool is absent), and read back as samples."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["PROMTOOL", "needs_promtool", "assert_promtool_passes", "samples"]

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian's prometheus package ships it; .ci/run installs it when root)",
)


def assert_promtool_passes(text: bytes) -> None:
    """``promtool check metrics`` finds no error and no lint problem in `text`."""
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def samples(text: bytes | str, name: str) -> list[tuple[dict[str, str], float]]:
    """The (labels, value) of every sample named `name` (``_total`` included) in `text`."""
    decoded = text.decode() if isinstance(text, bytes) else text
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(decoded)
        for s in family.samples
        if s.name == name
    ]
