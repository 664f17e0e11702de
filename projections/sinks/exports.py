"""Lazy re-exports for the sink packages' ``__init__``.

Why: ``kappaflow.config`` reads each sink's settings model (``sinks/<kind>/settings.py``) and must
not load the sink (its client libraries, Spark types) to do so, while users keep writing
``from kappaflow.projections.sinks.redis import RedisSink``. Each package therefore names its
exports once and imports a name from its module only when it is first used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, Iterable[str]]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of `package`: ``exports`` maps a module (relative to `package`,
    e.g. ``".sink"``, ``"..errors"``) to the names it provides; a name is imported on first use and
    then kept in the package (later lookups do not come here)."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
