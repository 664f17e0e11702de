"""The events package imports in one direction: types <- values <- schema <- connect <- json, no cycle.

A cycle hidden behind function-local imports used to tie schema, connect and values together; this
reads the modules' import statements (not their behaviour) so a new one shows up here first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kappaflow.events

EVENTS = Path(kappaflow.events.__file__).parent


def _module(path: Path) -> str:
    rel = path.relative_to(EVENTS).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["kappaflow.events", *parts])


def _events_imports(nodes: list[ast.stmt] | list[ast.AST]) -> list[str]:
    return [n.module for n in nodes
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("kappaflow.events")]


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(kappaflow.events modules imported at module level, those imported inside functions or classes).

    ``if TYPE_CHECKING:`` imports are for annotations only and count as neither."""
    tree = ast.parse(path.read_text())
    top = set(_events_imports(tree.body))
    top |= {f"{n.module}.{a.name}" for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("kappaflow.events") for a in n.names}
    local = [m for d in tree.body if isinstance(d, ast.FunctionDef | ast.ClassDef)
             for m in _events_imports(list(ast.walk(d)))]
    return top, local


def test_no_function_local_imports_inside_events() -> None:
    found = {_module(p): local for p in EVENTS.rglob("*.py") if (local := _imports(p)[1])}
    assert not found, f"function-local imports of kappaflow.events modules (an import cycle?): {found}"


def test_the_events_modules_import_without_a_cycle() -> None:
    modules = {_module(p): p for p in EVENTS.rglob("*.py")}
    graph = {m: {t for t in _imports(p)[0] if t in modules and t != m} for m, p in modules.items()}
    # a package imports its own submodules to register them; only cycles between other modules count
    graph = {m: {t for t in deps if not t.startswith(m + ".")} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, "import cycle: " + " -> ".join([*path[path.index(m):], m])
        if m in done:
            return
        for dep in sorted(graph[m]):
            visit(dep, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_events_import_no_connector_and_load_the_source_info_on_demand() -> None:
    """Positions and source blocks belong to the connectors; importing the events package imports none
    of them, and a fresh interpreter finds every kind when it first needs one, without the drivers."""
    import subprocess
    import sys

    for p in EVENTS.rglob("*.py"):
        tree = ast.parse(p.read_text())
        top = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in top if m.startswith("kappaflow.connectors")], f"{p} imports a connector"
    script = (
        "import sys, kappaflow.events as e\n"
        "assert not [m for m in sys.modules if m.startswith('kappaflow.connectors')], 'imported a connector'\n"
        "p = e.Position.from_dict({'kind': 'binlog', 'file': 'mysql-bin.000003', 'pos': 4, 'row': 1})\n"
        "assert type(p).__name__ == 'BinlogPosition' and p == e.BinlogPosition('mysql-bin.000003', 4, 1)\n"
        "drivers = [m for m in ('psycopg', 'pymysql', 'pymysqlreplication', 'confluent_kafka') if m in sys.modules]\n"
        "assert not drivers, drivers\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
