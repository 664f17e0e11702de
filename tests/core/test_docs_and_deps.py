"""What the repository says exists does exist (issue 13 item 12).

Regressions: docstrings pointed at a design document and an events API document that are not in the
repository; ``pydantic-settings`` was a dependency nothing imported.
"""

from __future__ import annotations

import ast
import re
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("kappaflow", "connectors", "projections", "ledger", "migrations", "examples", "bench", "tests",
               "scripts", "compose")


def _files(*suffixes: str) -> list[Path]:
    out = [p for p in ROOT.glob("*") if p.is_file() and p.suffix in suffixes]
    for d in SOURCE_DIRS:
        out += [p for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in suffixes]
    return out


def test_every_markdown_file_named_in_the_repository_exists() -> None:
    existing = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    missing = []
    for path in _files(".py", ".md", ".toml", ".sh", ".yml", ".sql"):
        for name in re.findall(r"\b([A-Za-z0-9_.-]+\.md)\b", path.read_text(errors="replace")):
            if name not in existing:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)


def _imported_top_level() -> set[str]:
    names: set[str] = set()
    for path in _files(".py"):
        if path.is_relative_to(ROOT / "tests") or path.is_relative_to(ROOT / "bench"):
            continue  # the runtime dependencies are what the package itself imports
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


# Needed at run time by another dependency, never imported by kappaflow itself.
USED_BY_DEPENDENCIES = {
    "crc32c": "kafka-python computes record-batch CRC-32C with it (a pure-Python fallback otherwise)",
    "pandas": "PySpark's mapInArrow (every fold and sink load) requires it (require_minimum_pandas_version)",
}


def test_every_runtime_dependency_is_imported() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    dists = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    provided: dict[str, set[str]] = {}
    for module, owners in packages_distributions().items():
        for owner in owners:
            provided.setdefault(owner.lower().replace("_", "-"), set()).add(module)
    imported = _imported_top_level()
    unused = sorted(d for d in dists if not (provided.get(d, set()) & imported) and d not in USED_BY_DEPENDENCIES)
    assert not unused, f"dependencies in pyproject.toml that kappaflow never imports: {unused}"
