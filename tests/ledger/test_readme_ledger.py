"""The README's ledger example (the DCB course) runs as written against a real ledger.

``tests/projections/test_readme.py`` runs the README's projection blocks; blocks that say they are
run by this file are left to it, because they need a ledger database rather than a captured shop.
"""

from __future__ import annotations

import re
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from kappaflow.ledger import AppendConditionFailedError, Ledger

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "tests/ledger/test_readme_ledger.py"


def ledger_blocks() -> list[str]:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    return [b for b in blocks if MARK in b.splitlines()[0]]


def test_the_course_example_admits_up_to_capacity_and_conditions_catch_a_race(ledger_dsn: str) -> None:
    blocks = ledger_blocks()
    assert blocks, f"README.md has no ```python block marked {MARK!r}"
    module = types.ModuleType(f"readme_ledger_{uuid.uuid4().hex[:8]}")
    sys.modules[module.__name__] = module
    try:
        for code in blocks:
            exec(compile(code, "README.md", "exec"), module.__dict__)  # the README's own code
        ns: Any = module
        with Ledger(ledger_dsn, registry=ns.registry) as led:
            led.append("course-7", [ns.CourseDefined(course_id="7", capacity=2)])
            assert ns.enrol(led, "a", "7") is True
            assert ns.enrol(led, "b", "7") is True
            assert ns.enrol(led, "c", "7") is False  # full

            # a decision made on a stale read fails instead of over-booking the course
            led.append("course-8", [ns.CourseDefined(course_id="8", capacity=1)])
            q = ns.Query.where(tags=["course:8"], types=["CourseDefined", "StudentEnrolled"])
            stale = led.read_query(q)
            assert ns.enrol(led, "d", "8") is True
            with pytest.raises(AppendConditionFailedError):
                led.append("enrolment-e-8", [ns.StudentEnrolled(student_id="e", course_id="8")],
                           condition=stale.condition)
            assert led.read_query(q).events[-1].event.student_id == "d"
    finally:
        sys.modules.pop(module.__name__, None)
