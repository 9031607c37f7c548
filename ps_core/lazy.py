"""Lazy re-exports for the packages' `__init__` modules (PEP 562).

A package lists its public names in `__all__` and imports them only under
`TYPE_CHECKING` (mypy and IDEs see the real names and types); at run time
`lazy_exports` gives it a module `__getattr__` that imports a name's module
on first use. Importing one module of a package thus loads that module and
what it imports itself, not the whole package: a decoding process loads
neither aiohttp nor the checkpoints. Imports nothing of the project.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, re-exporting each name of
    `exports` (relative module -> names) from its module on first access."""
    home = {name: module for module, names in exports.items() for name in names}
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> object:
        module = home.get(name)
        if module is None:
            # AttributeError (not ImportError): `from package import submodule`
            # relies on it to go on and import the submodule.
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later lookups find it without coming back here
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *home})

    return __getattr__, __dir__
