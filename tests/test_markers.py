"""The suite's markers: `kafka` follows the session broker's fixture, and
every marker is registered."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")
PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"


def test_tests_using_the_session_broker_are_marked_kafka_and_only_they(pytester: pytest.Pytester) -> None:
    # Collection only: the broker fixture is named, never started.
    # The project's conftest and registered markers (an unregistered one is
    # an error here, as in the suite).
    pytester.makeconftest(CONFTEST.read_text())
    ini = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]
    markers = "".join(f"    {m}\n" for m in ini["markers"])
    pytester.makeini(f"[pytest]\nmarkers =\n{markers}asyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(
        test_uses="""
        import pytest

        @pytest.fixture
        def topic(kafka_bootstrap):
            return kafka_bootstrap

        def test_direct(kafka_bootstrap):
            pass

        def test_through_a_fixture(topic):
            pass

        def test_without(tmp_path):
            pass
        """
    )
    marked = pytester.runpytest("--collect-only", "-q", "-m", "kafka", "-p", "no:cacheprovider")
    assert marked.ret == 0, marked.stdout.str()
    selected = [line.split("::")[1] for line in marked.stdout.lines if "::" in line]
    assert selected == ["test_direct", "test_through_a_fixture"]
    unmarked = pytester.runpytest("--collect-only", "-q", "-m", "not kafka", "-p", "no:cacheprovider")
    assert [line.split("::")[1] for line in unmarked.stdout.lines if "::" in line] == ["test_without"]
