"""Fold kinds are dispatched by the registry (fold class -> strategy), never by isinstance checks
spread over the engine: a new kind is a module plus a registration."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kappaflow.errors import ConfigError
from kappaflow.projections import Count, Projection, ProjectionSpec
from kappaflow.projections.api import CustomFold, Declaration, FoldSpec, GroupFold, LatestFold
from kappaflow.projections.folds import CustomStrategy, GroupedStrategy, LatestStrategy, register, strategy_for
from kappaflow.projections.folds.base import _REGISTRY, FoldStrategy

PROJECTIONS = Path(__file__).resolve().parents[2] / "projections"
FOLD_KINDS = ("latest", "grouped", "custom")


def spec(**attrs: Any) -> ProjectionSpec:
    base = {"name": "p", "sources": ["s.public.t"], "key": ["id"]}
    base.update(attrs)
    return ProjectionSpec.from_class(type("P", (Projection,), base))


def test_every_fold_kind_has_its_strategy() -> None:
    def apply(self: Any, row: Any, event: Any) -> Any:
        return row

    assert isinstance(strategy_for(spec()), LatestStrategy)
    assert isinstance(strategy_for(spec(aggregates={"n": Count()}, key=["g"])), GroupedStrategy)
    assert isinstance(strategy_for(spec(apply=apply, schema="id bigint")), CustomStrategy)
    for fold in (LatestFold(), GroupFold(), CustomFold()):
        assert strategy_for(fold).fold is type(fold)


def test_mirror_policy_and_supported_sinks_come_from_the_strategy() -> None:
    grouped = spec(aggregates={"n": Count()}, key=["g"], sinks=("postgres", "search", "redis"))
    assert [grouped.strategy.mirror_source(grouped, s) for s in grouped.sinks] == [None, "postgres", "postgres"]
    latest = spec(sinks=("postgres", "redis"))
    assert [latest.strategy.mirror_source(latest, s) for s in latest.sinks] == [None, None]
    with pytest.raises(ConfigError, match="'sinks': a grouped projection"):
        spec(aggregates={"n": Count()}, key=["g"], sinks=("redis",))


@dataclass(frozen=True)
class _EveryOther(FoldSpec):
    """A toy fold kind: only registration makes it known."""

    kind: ClassVar[str] = "every_other"


class _EveryOtherStrategy(FoldStrategy):
    fold = _EveryOther
    priority = 200

    def claims(self, decl: Declaration) -> bool:
        return bool(getattr(decl.klass, "every_other", False))

    def declare(self, decl: Declaration) -> FoldSpec:
        return _EveryOther()

    def fingerprint(self, spec: ProjectionSpec) -> list[str]:
        return ["every-other"]

    def compile(self, spark: Any, spec: ProjectionSpec, schemas: Any) -> Any:
        raise NotImplementedError("not compiled in this test")

    def build(self, job: Any) -> Any:
        raise NotImplementedError("not built in this test")

    def fold_batch(self, plan: Any, rt: Any, sink: Any, target: Any, raws: Any, deduped_input: Any) -> Any:
        raise NotImplementedError("not followed in this test")


def test_a_new_fold_kind_is_a_registration() -> None:
    assert spec(every_other=True).kind == "latest"  # unknown until registered
    strategy = register(_EveryOtherStrategy())
    try:
        s = spec(every_other=True)
        assert s.kind == "every_other" and strategy_for(s) is strategy
        assert s.fingerprint() != spec().fingerprint()
        assert spec().kind == "latest"  # other classes are not claimed by it
        with pytest.raises(ConfigError, match="registered already"):
            register(type("Other", (_EveryOtherStrategy,), {})())
    finally:
        del _REGISTRY[_EveryOther]


_SCAN = """
import ast, json, sys
from pathlib import Path
root, kinds, fold_kinds = Path(sys.argv[1]), set(sys.argv[2].split(",")), set(sys.argv[3].split(","))
offenders = []
for path in sorted(root.rglob("*.py")):
    if "folds" in path.relative_to(root).parts:
        continue
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if names & kinds:
                offenders.append(f"{path.name}:{node.lineno}")
        if (
            isinstance(node, ast.Compare)
            and getattr(node.left, "attr", None) == "kind"
            and any(isinstance(c, ast.Constant) and c.value in fold_kinds for c in node.comparators)
        ):
            offenders.append(f"{path.name}:{node.lineno}")
print(json.dumps(offenders))
"""


def test_nothing_outside_folds_branches_on_the_fold_kind() -> None:
    """No isinstance(..., LatestFold/GroupFold/CustomFold) and no fold-kind string compare outside
    projections/folds/; no sink-kind compare or hasattr probe in the engine and the mirrors.

    The source scan runs in a process of its own: CPython 3.11's ``ast`` conversion keeps its
    recursion depth in shared state that another thread of this test session parsing at the same
    moment corrupts ("AST constructor recursion depth mismatch", python/cpython#106905)."""
    kinds = {"LatestFold", "GroupFold", "CustomFold"}
    scan = subprocess.run(
        [sys.executable, "-c", _SCAN, str(PROJECTIONS), ",".join(sorted(kinds)), ",".join(sorted(FOLD_KINDS))],
        capture_output=True, text=True, timeout=120, check=True,
    )
    offenders: list[str] = json.loads(scan.stdout)
    for name in ("engine.py", "mirror.py", "loader.py"):
        text = (PROJECTIONS / name).read_text()
        for probe in ('.kind == "', '.kind != "', "hasattr(sink"):
            if probe in text:
                offenders.append(f"{name}: {probe}")
    assert not offenders, offenders
