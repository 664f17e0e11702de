"""Conditional appends across streams (dynamic consistency boundaries): tags, queries, conditions.

The semantics are the DCB specification's (dcb.events/specification: a query is a union of
items; an item matches an event whose type is one of its types, or any type when it lists none,
AND that carries all of its tags; an append condition fails if an event matching its query was
appended after its position) and its two canonical examples: a course that admits a limited
number of students across enrolment streams, and a username unique across accounts.
"""

from __future__ import annotations

import random
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kappaflow.ledger import (
    AppendCondition,
    AppendConditionFailedError,
    AppendConflictError,
    EventRegistry,
    InvalidAppendError,
    Ledger,
    LedgerRelay,
    NewEvent,
    Query,
    QueryItem,
    Tagged,
)
from kappaflow.ledger.logmap import record_tags

pytestmark = pytest.mark.integration


class StudentEnrolled(BaseModel):
    student_id: str
    course_id: str


class CourseDefined(BaseModel):
    course_id: str
    capacity: int


def registry() -> EventRegistry:
    reg = EventRegistry(strict=False)  # NewEvents of other types too
    reg.register(StudentEnrolled, tags={"student": "student_id", "course": "course_id"})
    reg.register(CourseDefined, tags={"course": "course_id"})
    return reg


def enrol(ledger: Ledger, student: str, course: str) -> bool:
    """The DCB course example: capacity and enrolments live in different streams."""
    q = Query.where(tags=[f"course:{course}"], types=["CourseDefined", "StudentEnrolled"])
    seen = ledger.read_query(q)
    capacity = next(e.event.capacity for e in seen.events if e.event_type == "CourseDefined")
    enrolled = sum(1 for e in seen.events if e.event_type == "StudentEnrolled")
    if enrolled >= capacity:
        return False
    ledger.append(f"enrolment-{student}-{course}", [StudentEnrolled(student_id=student, course_id=course)],
                  condition=seen.condition)
    return True


def test_tags_are_stored_read_and_declared_per_class(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        ledger.append("course-7", [CourseDefined(course_id="7", capacity=2)])
        ledger.append("enrolment-1", [Tagged(StudentEnrolled(student_id="1", course_id="7"), ["term:2026"])])
        ledger.append("note-1", [NewEvent("Noted", {"x": 1}, tags=["course:7", "course:7", "by:ann"])],
                      stream_type="note")
        events = ledger.read_all(decode=False)
        assert [e.tags for e in events] == [("course:7",), ("course:7", "student:1", "term:2026"),
                                            ("by:ann", "course:7")]  # sorted, de-duplicated
        assert ledger.read_stream("enrolment-1")[0].tags == ("course:7", "student:1", "term:2026")
        assert ledger.verify().ok


def test_read_query_returns_matching_events_and_the_position_to_condition_on(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        ledger.append("course-7", [CourseDefined(course_id="7", capacity=2)])                   # 1
        ledger.append("course-8", [CourseDefined(course_id="8", capacity=5)])                   # 2
        ledger.append("enrolment-a", [StudentEnrolled(student_id="a", course_id="7")])          # 3
        ledger.append("enrolment-b", [StudentEnrolled(student_id="b", course_id="8")])          # 4
        ledger.append("misc-1", [NewEvent("Other", {})])                                         # 5

        def positions(q: Query, **kw: Any) -> list[int]:
            return [e.position for e in ledger.read_query(q, decode=False, **kw).events]

        assert positions(Query.where(tags=["course:7"])) == [1, 3]
        assert positions(Query.where(tags=["course:7"], types=["StudentEnrolled"])) == [3]
        assert positions(Query.where(tags=["course:8", "student:b"])) == [4]  # AND within an item
        assert positions(Query.where(tags=["course:7", "student:b"])) == []
        assert positions(Query.where(tags=["course:7"]) | Query.where(tags=["student:b"])) == [1, 3, 4]  # OR
        assert positions(Query.where(types=["CourseDefined"])) == [1, 2]  # types only
        assert positions(Query.all()) == [1, 2, 3, 4, 5]
        assert positions(Query.all(), after=3, limit=1) == [4]
        assert positions(Query.where(tags=["student:b"]) | Query.all(), after=1) == [2, 3, 4, 5]
        assert positions(Query.where(tags=["course:7"]), after=1) == [3]
        assert positions(Query.where(tags=["course:7"]) | Query.where(types=["Other"]), limit=2) == [1, 3]
        result = ledger.read_query(Query.where(tags=["course:9"]), decode=False)
        assert (result.events, result.position) == ([], 5)  # nothing matches; the head is the position
        assert result.condition == AppendCondition(Query.where(tags=["course:9"]), 5)
        assert result.events == [] and ledger.read_query(Query.where(tags=["course:7"])).events[1].event == \
            StudentEnrolled(student_id="a", course_id="7")
        q = Query.where(tags=["course:7"], types=["StudentEnrolled"])
        assert q.matches("StudentEnrolled", ["student:x", "course:7"]) and not q.matches("CourseDefined", ["course:7"])


def test_condition_holds_until_a_matching_event_arrives(ledger_dsn: str) -> None:
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        ledger.append("course-7", [CourseDefined(course_id="7", capacity=2)])
        assert enrol(ledger, "a", "7") and enrol(ledger, "b", "7")
        assert not enrol(ledger, "c", "7")  # full

        q = Query.where(tags=["course:8"])
        seen = ledger.read_query(q)
        ledger.append("misc-1", [NewEvent("Other", {}, tags=["course:80"])])   # does not match: no conflict
        ledger.append("course-7", [NewEvent("Renamed", {}, tags=["course:7"])])  # other tag: no conflict
        ledger.append("enrolment-x", [NewEvent("Defined", {})], condition=seen.condition)
        late = ledger.append("course-8", [CourseDefined(course_id="8", capacity=1)])
        with pytest.raises(AppendConditionFailedError) as err:
            ledger.append("enrolment-y", [NewEvent("Defined", {})], condition=seen.condition)
        e = err.value
        assert isinstance(e, AppendConflictError) and not e.transient
        assert (e.position, e.event_type, e.item, e.condition) == (late.position, "CourseDefined", 0, seen.condition)
        assert f"the event at position {late.position} (CourseDefined) matches query item [tags course:8]" in str(e)
        assert f"appended after position {seen.position}" in str(e)
        assert ledger.stream_version("enrolment-y") == 0

        # a typed item ignores other types; the second item of a union is named when it fails
        q2 = Query.where(tags=["course:8"], types=["StudentEnrolled"]) | Query.where(tags=["student:z"])
        seen2 = ledger.read_query(q2, decode=False)
        ledger.append("course-8", [NewEvent("Renamed", {}, tags=["course:8"])])
        ledger.append("enrolment-z", [NewEvent("Noted", {}, tags=["student:z"])])
        with pytest.raises(AppendConditionFailedError) as err2:
            ledger.append("w-1", [NewEvent("X", {})], condition=seen2.condition)
        assert err2.value.item == 1
        # with an expected version too: both must hold
        with pytest.raises(AppendConditionFailedError):
            ledger.append("w-1", [NewEvent("X", {})], 0, condition=seen2.condition)
        assert ledger.verify().ok


def test_unique_username_across_accounts(ledger_dsn: str) -> None:
    """The DCB uniqueness example: no aggregate owns usernames; the condition guards the claim."""
    with Ledger(ledger_dsn) as ledger:
        def register(account: str, name: str) -> bool:
            q = Query.where(tags=[f"username:{name}"])
            seen = ledger.read_query(q)
            if seen.events:
                return False
            try:
                ledger.append(f"account-{account}", [NewEvent("AccountRegistered", {"name": name},
                                                              tags=[f"username:{name}"])], condition=seen.condition)
            except AppendConditionFailedError:
                return False
            return True

        results: dict[str, bool] = {}
        barrier = threading.Barrier(6)

        def racer(i: int) -> None:
            barrier.wait()
            results[str(i)] = register(str(i), "ann")

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results.values()) == [False] * 5 + [True]
        assert len(ledger.read_query(Query.where(tags=["username:ann"])).events) == 1


def test_two_writers_that_read_the_same_state_exactly_one_wins(ledger_dsn: str) -> None:
    """Both read (overlapping queries) before either appends; the appends then race: one commits,
    the other gets the typed conflict naming its condition and the winner's event."""
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        ledger.append("course-7", [CourseDefined(course_id="7", capacity=1)])
        read_both = threading.Barrier(2)
        outcome: dict[str, Any] = {}

        def writer(student: str, extra_tag: str) -> None:
            q = Query.where(tags=["course:7"]) | Query.where(tags=[extra_tag])
            seen = ledger.read_query(q)
            read_both.wait()
            try:
                outcome[student] = ledger.append(
                    f"enrolment-{student}", [StudentEnrolled(student_id=student, course_id="7")],
                    condition=seen.condition)
            except AppendConditionFailedError as exc:
                outcome[student] = exc

        threads = [threading.Thread(target=writer, args=(s, f"desk:{s}")) for s in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        errs = [v for v in outcome.values() if isinstance(v, AppendConditionFailedError)]
        wins = [v for v in outcome.values() if not isinstance(v, AppendConditionFailedError)]
        assert len(errs) == len(wins) == 1
        assert (errs[0].position, errs[0].event_type, errs[0].item) == (wins[0].position, "StudentEnrolled", 0)
        assert errs[0].condition.after == 1 and "matches query item [tags course:7]" in str(errs[0])


@dataclass
class Attempt:
    writer: int
    query: Query
    after: int
    tags: list[str]
    ok: bool = False
    position: int = 0
    conflict: AppendConditionFailedError | None = None


TAG_POOL = list(range(4))


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plans=st.lists(st.lists(st.tuples(st.sets(st.sampled_from(TAG_POOL), min_size=1, max_size=2),
                                         st.sets(st.sampled_from(TAG_POOL), min_size=1, max_size=2)),
                               min_size=1, max_size=5), min_size=2, max_size=5),
       seed=st.integers(0, 1000))
def test_racing_writers_on_overlapping_tags_are_serialisable(ledger_dsn: str, plans: list[Any], seed: int) -> None:
    """Writers read by a query, then append with its condition, racing each other. Whatever the
    interleaving: an append succeeded only if no event matching its query landed between its read
    and its commit, and every conflict names a real, later, matching event."""
    prefix = "k" + uuid.uuid4().hex[:6]
    attempts: list[Attempt] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(plans))
    with Ledger(ledger_dsn, pool_size=len(plans)) as ledger:
        def writer(w: int, plan: list[Any]) -> None:
            try:
                write(w, plan)
            except BaseException as exc:
                errors.append(exc)

        def write(w: int, plan: list[Any]) -> None:
            rnd = random.Random(seed + w)
            barrier.wait()
            for read_tags, write_tags in plan:
                tags = [f"{prefix}:{t}" for t in sorted(read_tags)]
                q = Query.where(tags=tags[:1])
                for t in tags[1:]:
                    q = q | Query.where(tags=[t])
                seen = ledger.read_query(q)
                if rnd.random() < 0.5:
                    threading.Event().wait(rnd.random() * 0.005)  # widen some race windows
                a = Attempt(w, q, seen.position, [f"{prefix}:{t}" for t in sorted(write_tags)])
                try:
                    r = ledger.append(f"w{prefix}-{w}", [NewEvent("Wrote", {"w": w}, tags=a.tags)],
                                      condition=seen.condition)
                    a.ok, a.position = True, r.position
                except AppendConditionFailedError as exc:
                    a.conflict = exc
                with lock:
                    attempts.append(a)

        threads = [threading.Thread(target=writer, args=(w, p)) for w, p in enumerate(plans)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a writer hung"
        assert not errors, errors[0]
        events = {e.position: e for e in ledger.read_all(limit=10_000) if e.stream_id.startswith(f"w{prefix}")}
    assert len(attempts) == sum(len(p) for p in plans)
    assert len(events) == sum(a.ok for a in attempts)
    for a in attempts:
        if a.ok:
            between = [e for p, e in events.items()
                       if a.after < p < a.position and a.query.matches(e.event_type, e.tags)]
            assert not between, f"writer {a.writer} appended at {a.position} over matching events {between}"
        else:
            assert a.conflict is not None
            hit = events[a.conflict.position]
            assert a.conflict.position > a.after and a.query.matches(hit.event_type, hit.tags)
            assert a.conflict.item == next(i for i, item in enumerate(a.query.items)
                                           if item.matches(hit.event_type, hit.tags))
    assert any(a.ok for a in attempts)


def test_tags_reach_the_log_as_headers(ledger_dsn: str, embedded_log: Any) -> None:
    with Ledger(ledger_dsn, registry=registry()) as ledger:
        ledger.append("enrolment-1", [StudentEnrolled(student_id="1", course_id="7")])
        ledger.append("misc-1", [NewEvent("Other", {})])
        relay = LedgerRelay(ledger, embedded_log, "school", partitions=1)
        while relay.run_once():
            pass
    recs = list(embedded_log.iter_partition("school.enrolment", 0))
    assert [record_tags(r.headers) for r in recs] == [["course:7", "student:1"]]
    assert record_tags(next(iter(embedded_log.iter_partition("school.misc", 0))).headers) == []


@pytest.mark.parametrize(("bad", "field", "message"), [
    (lambda: NewEvent("X", {}, tags=["course7"]), "events[0].tags[0]", "expected a tag 'name:value'"),
    (lambda: NewEvent("X", {}, tags=["7course:1"]), "events[0].tags[0]", "expected a tag 'name:value'"),
    (lambda: NewEvent("X", {}, tags=["course:"]), "events[0].tags[0]", "expected a tag 'name:value'"),
    (lambda: NewEvent("X", {}, tags=["a:b\nc"]), "events[0].tags[0]", "no control characters"),
    (lambda: NewEvent("X", {}, tags="course:7"), "events[0].tags", "not a single str"),
    (lambda: NewEvent("X", {}, tags=[7]), "events[0].tags[0]", "got 7"),
])
def test_bad_tags_fail_with_a_clear_error(ledger: Ledger, bad: Any, field: str, message: str) -> None:
    with pytest.raises(InvalidAppendError) as err:
        ledger.append("x-1", [bad()])
    assert err.value.field == field
    assert message.replace("not a single str", "got a single str") in str(err.value)
    assert ledger.head().position == 0


def test_bad_queries_and_conditions_fail_with_a_clear_error(ledger: Ledger) -> None:
    with pytest.raises(InvalidAppendError, match=r"query.tags\[0\]: expected a tag 'name:value'"):
        Query.where(tags=["nocolon"])
    with pytest.raises(InvalidAppendError, match="at least one type or tag"):
        Query.where()
    with pytest.raises(InvalidAppendError, match="query: a query needs at least one item"):
        Query(())
    with pytest.raises(InvalidAppendError, match=r"condition.after: expected a ledger position >= 0"):
        AppendCondition(Query.all(), -1)
    ledger.append("x-1", [NewEvent("X", {}, tags=["a:1"])])
    # a position from the future (the head is 1): refused, nothing written
    with pytest.raises(InvalidAppendError) as err:
        ledger.append("x-2", [NewEvent("X", {})], condition=AppendCondition(Query.where(tags=["a:1"]), 5))
    assert err.value.field == "condition.after"
    assert "expected a position <= the ledger head 1, got 5" in str(err.value)
    assert ledger.stream_version("x-2") == 0
    with pytest.raises(InvalidAppendError, match="condition: expected an AppendCondition"):
        ledger.append("x-2", [NewEvent("X", {})], condition=Query.all())  # type: ignore[arg-type]
    with pytest.raises(InvalidAppendError, match="query: expected a Query"):
        ledger.read_query(QueryItem(tags=("a:1",)))  # type: ignore[arg-type]
    with pytest.raises(InvalidAppendError, match=r"tags\['7x'\]"):
        EventRegistry().register(StudentEnrolled, tags={"7x": "student_id"})
