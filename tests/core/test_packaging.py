"""The wheel must contain every package folder (discovery cannot follow package-dir mapping)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> tuple[set[str], dict[str, str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"]), cfg["package-dir"]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    packages, mapping = _declared()
    found: set[str] = set()
    for name, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if any(part.startswith((".", "__")) for part in rel.parts):
                continue
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    missing = sorted(found - packages)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_mapped_packages_import_under_the_kappaflow_namespace() -> None:
    import kappaflow.connectors
    import kappaflow.ledger
    import kappaflow.migrations
    import kappaflow.projections

    assert Path(kappaflow.connectors.__file__ or "").parent == ROOT / "connectors"
    assert Path(kappaflow.projections.__file__ or "").parent == ROOT / "projections"
    assert Path(kappaflow.ledger.__file__ or "").parent == ROOT / "ledger"
    assert Path(kappaflow.migrations.__file__ or "").parent == ROOT / "migrations"
