"""The sink contract test suite: every sink runs it (like the log's ``kappaflow.log.testing``).

Use it from a test module by subclassing and providing a ``sink`` fixture that yields a
fresh, open sink (and, optionally, overriding ``namespace``)::

    from kappaflow.projections.sinks.testing import SinkContract

    class TestPostgresSinkContract(SinkContract):
        @pytest.fixture
        def sink(self, pg_dsn):
            s = PostgresSink(pg_dsn)
            yield s
            s.close()

Every test uses its own view name, so sinks on shared servers do not interfere.
"""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import types as T

from kappaflow.errors import SinkError
from kappaflow.projections.sinks.base import (
    DELETED,
    VERSION,
    Sink,
    ViewColumn,
    ViewSchemaMismatch,
    ViewSpec,
    batch_from_rows,
)


def contract_view(name: str, namespace: str | None = None) -> ViewSpec:
    """A view with the column types projections produce most."""
    return ViewSpec(
        name=name,
        projection=f"contract_{name}",
        key=("id",),
        columns=(
            ViewColumn("id", T.LongType(), False),
            ViewColumn("name", T.StringType()),
            ViewColumn("total", T.DecimalType(12, 2)),
            ViewColumn("score", T.DoubleType()),
            ViewColumn("active", T.BooleanType()),
            ViewColumn("born", T.DateType()),
            ViewColumn("seen_at", T.TimestampType()),
            ViewColumn("tags", T.ArrayType(T.StringType())),
        ),
        namespace=namespace,
    )


def contract_row(i: int, version: int, *, name: str | None = None, deleted: bool = False) -> dict[str, Any]:
    return {
        "id": i,
        "name": name if name is not None else f'name {i} ü "q" , \\ \n',
        "total": Decimal(f"{i}.{i % 100:02d}"),
        "score": i / 7,
        "active": i % 2 == 0,
        "born": date(2000, 1, 1 + i % 28),
        "seen_at": datetime(2024, 5, 1, 12, 0, i % 60, 123456, tzinfo=UTC),
        "tags": ["a", f"t{i % 3}"],
        VERSION: version,
        DELETED: deleted,
    }


def _plain(row: dict[str, Any], view: ViewSpec) -> dict[str, Any]:
    return {c: row.get(c) for c in (*view.column_names, VERSION)}


def evolving_views(name: str, namespace: str | None = None) -> tuple[ViewSpec, ViewSpec]:
    """A view and the same view after its source evolved: ``note`` added, ``n`` int -> bigint,
    ``amount`` numeric(10,2) -> numeric(14,2) (same scale)."""
    before = ViewSpec(name, f"contract_{name}", ("id",), (
        ViewColumn("id", T.LongType(), False),
        ViewColumn("n", T.IntegerType()),
        ViewColumn("amount", T.DecimalType(10, 2)),
        ViewColumn("label", T.StringType()),
    ), namespace)
    after = ViewSpec(name, before.projection, ("id",), (
        ViewColumn("id", T.LongType(), False),
        ViewColumn("n", T.LongType()),
        ViewColumn("amount", T.DecimalType(14, 2)),
        ViewColumn("label", T.StringType()),
        ViewColumn("note", T.StringType()),
    ), namespace)
    return before, after


class SinkContract:
    """Subclass and provide a ``sink`` fixture (see the module docstring)."""

    namespace: str | None = None
    widens_integers_in_place: bool = True
    """False for a store whose field type for an int cannot become a bigint's in place (a search
    index maps them as ``integer`` / ``long``): ``evolve`` then refuses it (the view needs a rebuild)."""

    @pytest.fixture
    def view(self) -> ViewSpec:
        return contract_view("kfc_" + uuid.uuid4().hex[:10], self.namespace)

    # -- helpers ---------------------------------------------------------------------------
    def write(
        self,
        sink: Sink,
        target: Any,
        view: ViewSpec,
        rows: list[dict[str, Any]],
        positions: dict[tuple[str, int], int] | None = None,
    ) -> Any:
        return sink.write(target, batch_from_rows(view, rows), positions)

    def state(self, sink: Sink, target: Any, view: ViewSpec) -> dict[int, dict[str, Any]]:
        return {r["id"]: _plain(r, view) for r in sink.scan(target)}

    # -- targets ---------------------------------------------------------------------------
    def test_ensure_creates_and_is_idempotent(self, sink: Sink, view: ViewSpec) -> None:
        assert sink.live(view) is None
        t1 = sink.ensure(view)
        t2 = sink.ensure(view)
        assert t1 == t2 and not t1.shadow
        assert sink.live(view) == t1
        assert sink.count(t1) == 0
        assert sink.read_positions(t1) == {}

    def test_ensure_rejects_a_different_schema(self, sink: Sink, view: ViewSpec) -> None:
        sink.ensure(view)
        changed = ViewSpec(
            view.name,
            view.projection,
            view.key,
            (
                *(c if c.name != "total" else ViewColumn("total", T.StringType()) for c in view.columns),
                ViewColumn("extra", T.LongType()),
            ),
            view.namespace,
        )
        with pytest.raises(ViewSchemaMismatch) as err:
            sink.ensure(changed)
        assert "total" in str(err.value) and "extra" in str(err.value)

    # -- versioned writes ------------------------------------------------------------------
    def test_upsert_then_fetch_and_scan(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        rows = [contract_row(i, 10 + i) for i in range(1, 6)]
        res = self.write(sink, t, view, rows)
        assert res.upserted == 5
        assert sink.count(t) == 5
        got = sink.fetch(t, [(1,), (3,), (99,)])
        assert set(got) == {(1,), (3,)}
        assert _plain(got[(3,)], view) == _plain(rows[2], view)
        assert self.state(sink, t, view) == {r["id"]: _plain(r, view) for r in rows}
        assert [r["id"] for r in sink.scan(t)] == [1, 2, 3, 4, 5]

    def test_values_round_trip(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        odd = contract_row(7, 1)
        odd.update(name="", tags=[], score=-0.0, total=Decimal("-0.01"))
        nulls = {"id": 8, VERSION: 1, DELETED: False}
        self.write(sink, t, view, [odd, nulls])
        got = sink.fetch(t, [(7,), (8,)])
        assert _plain(got[(7,)], view) == _plain(odd, view)
        assert _plain(got[(8,)], view) == {**{c: None for c in view.column_names}, "id": 8, VERSION: 1}

    def test_stale_and_equal_versions_have_no_effect(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        self.write(sink, t, view, [contract_row(1, 10, name="v10")])
        self.write(sink, t, view, [contract_row(1, 5, name="v5")])  # older
        self.write(sink, t, view, [contract_row(1, 10, name="again")])  # same version
        assert sink.fetch(t, [(1,)])[(1,)]["name"] == "v10"
        self.write(sink, t, view, [contract_row(1, 11, name="v11")])
        assert sink.fetch(t, [(1,)])[(1,)]["name"] == "v11"

    def test_the_same_batch_twice_is_idempotent(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        batch = [contract_row(i, i) for i in range(20)] + [contract_row(3, 50, deleted=True)]
        self.write(sink, t, view, batch, {("t", 0): 51})
        first = self.state(sink, t, view)
        self.write(sink, t, view, batch, {("t", 0): 51})
        assert self.state(sink, t, view) == first
        assert 3 not in first and len(first) == 19

    def test_a_key_twice_in_one_batch_keeps_the_newest(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        self.write(sink, t, view, [contract_row(1, 7, name="new"), contract_row(1, 3, name="old")])
        assert sink.fetch(t, [(1,)])[(1,)]["name"] == "new"

    def test_deletes_are_guarded_by_version(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        self.write(sink, t, view, [contract_row(1, 10), contract_row(2, 10)])
        self.write(sink, t, view, [contract_row(1, 9, deleted=True)])  # stale delete
        self.write(sink, t, view, [contract_row(2, 11, deleted=True)])
        assert set(self.state(sink, t, view)) == {1}
        self.write(sink, t, view, [contract_row(2, 12, name="back")])  # re-insert after delete
        assert sink.fetch(t, [(2,)])[(2,)]["name"] == "back"

    def test_a_delete_is_not_undone_by_an_older_upsert(self, sink: Sink, view: ViewSpec) -> None:
        """After a delete there is no row to hold the version, yet the delete's version still
        guards the key: an upsert that is not newer has no effect (it would resurrect the row)."""
        t = sink.ensure(view)
        self.write(sink, t, view, [contract_row(1, 10, name="v10"), contract_row(4, 10, name="v10")])
        self.write(sink, t, view, [contract_row(1, 12, deleted=True)])
        self.write(sink, t, view, [contract_row(1, 11, name="v11")])  # older than the delete
        self.write(sink, t, view, [contract_row(1, 12, name="v12")])  # as old as the delete
        assert sink.fetch(t, [(1,)]) == {}, "an older upsert brought a deleted row back"
        # a delete of a key the view never held guards it too
        self.write(sink, t, view, [contract_row(2, 20, deleted=True)])
        self.write(sink, t, view, [contract_row(2, 5, name="v5")])
        # in one batch: the newer delete wins over the older upsert of the same key
        self.write(sink, t, view, [contract_row(3, 31, deleted=True), contract_row(3, 30, name="v30")])
        assert set(self.state(sink, t, view)) == {4}
        assert sink.count(t) == 1, "deleted keys must not count as rows"
        # a newer upsert after the delete brings the key back, and the delete guards no more
        self.write(sink, t, view, [contract_row(1, 13, name="v13")])
        self.write(sink, t, view, [contract_row(1, 14, name="v14")])
        assert sink.fetch(t, [(1,)])[(1,)]["name"] == "v14"
        assert set(self.state(sink, t, view)) == {1, 4}

    # -- positions -------------------------------------------------------------------------
    def test_positions_are_stored_with_writes_and_never_go_back(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        self.write(sink, t, view, [contract_row(1, 1)], {("a", 0): 5, ("a", 1): 7})
        assert sink.read_positions(t) == {("a", 0): 5, ("a", 1): 7}
        self.write(sink, t, view, [], {("a", 0): 9})
        sink.store_positions(t, {("a", 1): 3, ("b", 0): 1})  # 3 < 7: ignored
        assert sink.read_positions(t) == {("a", 0): 9, ("a", 1): 7, ("b", 0): 1}

    # -- shadows ---------------------------------------------------------------------------
    def test_shadow_build_and_swap(self, sink: Sink, view: ViewSpec) -> None:
        live = sink.ensure(view)
        self.write(sink, live, view, [contract_row(1, 1, name="old")], {("t", 0): 1})
        shadow = sink.begin_shadow(view)
        assert shadow.shadow and shadow.name != live.name
        assert sink.count(shadow) == 0
        assert sink.load(shadow, [batch_from_rows(view, [contract_row(i, 100 + i) for i in range(2, 6)])]) == 4
        sink.store_positions(shadow, {("t", 0): 100})
        assert self.state(sink, live, view).keys() == {1}  # the live view is untouched
        new_live = sink.swap(shadow)
        assert new_live == sink.live(view) and not new_live.shadow
        assert set(self.state(sink, new_live, view)) == {2, 3, 4, 5}
        assert sink.read_positions(new_live) == {("t", 0): 100}
        assert sink.count(sink.ensure(view)) == 4

    def test_a_leftover_shadow_is_replaced(self, sink: Sink, view: ViewSpec) -> None:
        sink.ensure(view)
        s1 = sink.begin_shadow(view)
        sink.load(s1, [batch_from_rows(view, [contract_row(1, 1)])])
        s2 = sink.begin_shadow(view)  # e.g. after a replay was killed
        assert sink.count(s2) == 0

    def test_drop(self, sink: Sink, view: ViewSpec) -> None:
        live = sink.ensure(view)
        self.write(sink, live, view, [contract_row(1, 1)], {("t", 0): 2})
        sink.drop(live)
        assert sink.live(view) is None
        again = sink.ensure(view)
        assert sink.count(again) == 0 and sink.read_positions(again) == {}

    def test_readers_never_see_an_empty_view_during_swaps(self, sink: Sink, view: ViewSpec) -> None:
        live = sink.ensure(view)
        self.write(sink, live, view, [contract_row(i, 1) for i in range(50)])
        reader = pickle.loads(pickle.dumps(sink.config())).open()
        seen: list[int] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def read() -> None:
            try:
                while not stop.is_set():
                    t = reader.live(view)
                    seen.append(reader.count(t) if t is not None else -1)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        th = threading.Thread(target=read)
        th.start()
        try:
            for gen in range(3):
                shadow = sink.begin_shadow(view)
                sink.load(shadow, [batch_from_rows(view, [contract_row(i, 10 + gen) for i in range(50 + gen)])])
                sink.swap(shadow)
                # let the reader look at the new generation a few times before the next swap
                seen_before = len(seen)
                deadline = time.monotonic() + 10
                while len(seen) < seen_before + 3 and not errors and th.is_alive():
                    assert time.monotonic() < deadline, "the reader took no samples after a swap within 10s"
                    time.sleep(0.001)
        finally:
            stop.set()
            th.join(30)
            reader.close()
        assert not errors, errors
        assert seen and all(n >= 50 for n in seen), sorted(set(seen))

    # -- config ----------------------------------------------------------------------------
    def test_config_opens_an_equivalent_sink(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        self.write(sink, t, view, [contract_row(1, 1)])
        other = pickle.loads(pickle.dumps(sink.config())).open()
        try:
            assert other.count(other.ensure(view)) == 1
        finally:
            other.close()

    def test_a_batch_without_the_meta_columns_is_refused(self, sink: Sink, view: ViewSpec) -> None:
        t = sink.ensure(view)
        with pytest.raises((SinkError, KeyError, ValueError)):
            sink.write(t, pa.table({"id": [1]}))


    # -- schema evolution in place (on_schema_change = "evolve") -----------------------------------
    def test_evolve_adds_a_column_keeping_rows_and_positions(self, sink: Sink) -> None:
        before, after = evolving_views("kfe_" + uuid.uuid4().hex[:10], self.namespace)
        after = ViewSpec(after.name, after.projection, after.key,
                         (*before.columns, ViewColumn("note", T.StringType())), after.namespace)
        t = sink.ensure(before)
        rows = [{"id": i, "n": i, "amount": Decimal(f"{i}.50"), "label": f"l{i}", VERSION: i, DELETED: False}
                for i in range(1, 4)]
        sink.write(t, batch_from_rows(before, rows), {("t", 0): 4})
        assert sink.evolve(before) == t  # nothing to do
        live = sink.evolve(after)
        assert live == sink.live(after) and not live.shadow
        assert sink.read_positions(live) == {("t", 0): 4}
        assert sink.count(live) == 3
        got = sink.fetch(live, [(1,)])[(1,)]
        assert got["note"] is None and got["label"] == "l1" and got[VERSION] == 1
        sink.write(live, batch_from_rows(after, [{"id": 2, "n": 2, "amount": Decimal("2.50"), "label": "l2",
                                                  "note": "new column", VERSION: 5, DELETED: False}]), {("t", 0): 6})
        assert sink.fetch(live, [(2,)])[(2,)]["note"] == "new column"
        assert sink.ensure(after) == live  # the store now matches the evolved view
        assert sink.evolve(after) == live  # idempotent (a follower may run it again after a crash)
        other = pickle.loads(pickle.dumps(sink.config())).open()
        try:
            assert other.fetch(other.ensure(after), [(2,)])[(2,)]["note"] == "new column"
        finally:
            other.close()

    def test_evolve_widens_types_in_place(self, sink: Sink) -> None:
        before, after = evolving_views("kfw_" + uuid.uuid4().hex[:10], self.namespace)
        t = sink.ensure(before)
        sink.write(t, batch_from_rows(before, [{"id": 1, "n": 7, "amount": Decimal("12345678.91"), "label": "x",
                                                VERSION: 1, DELETED: False}]), {("t", 0): 2})
        if not self.widens_integers_in_place:
            with pytest.raises(ViewSchemaMismatch) as err:
                sink.evolve(after)
            assert "'n'" in str(err.value) and "rebuild" in str(err.value).lower()
            assert sink.ensure(before) == t  # refused before changing anything
            after = ViewSpec(after.name, after.projection, after.key,
                             tuple(c if c.name != "n" else ViewColumn("n", T.IntegerType()) for c in after.columns),
                             after.namespace)
        live = sink.evolve(after)
        big = 2**40 if self.widens_integers_in_place else 8
        sink.write(live, batch_from_rows(after, [{"id": 2, "n": big, "amount": Decimal("123456789012.34"),
                                                  "label": "y", "note": "z", VERSION: 3, DELETED: False}]),
                   {("t", 0): 4})
        got = sink.fetch(live, [(1,), (2,)])
        assert got[(1,)]["n"] == 7 and got[(1,)]["amount"] == Decimal("12345678.91")
        assert got[(2,)]["n"] == big and got[(2,)]["amount"] == Decimal("123456789012.34")
        assert sink.read_positions(live) == {("t", 0): 4}
        assert sink.ensure(after) == live

    def test_evolve_refuses_what_needs_a_rebuild(self, sink: Sink) -> None:
        before, _ = evolving_views("kfr_" + uuid.uuid4().hex[:10], self.namespace)
        t = sink.ensure(before)
        sink.write(t, batch_from_rows(before, [{"id": 1, "n": 1, "label": "a", VERSION: 1, DELETED: False}]))
        dropped = ViewSpec(before.name, before.projection, before.key,
                           tuple(c for c in before.columns if c.name != "label"), before.namespace)
        narrowed = ViewSpec(before.name, before.projection, before.key,
                            tuple(c if c.name != "n" else ViewColumn("n", T.ShortType()) for c in before.columns),
                            before.namespace)
        retyped = ViewSpec(before.name, before.projection, before.key,
                           tuple(c if c.name != "label" else ViewColumn("label", T.LongType())
                                 for c in before.columns), before.namespace)
        for view, column in ((dropped, "label"), (narrowed, "n"), (retyped, "label")):
            with pytest.raises(ViewSchemaMismatch) as err:
                sink.evolve(view)
            assert column in str(err.value) and "kappaflow replay" in str(err.value), str(err.value)
        assert sink.ensure(before) == t  # untouched
        assert sink.fetch(t, [(1,)])[(1,)]["label"] == "a"

    # -- the projection lock (replay / follow) --------------------------------------------------
    def test_the_projection_lock_is_exclusive_and_released(self, sink: Sink, view: ViewSpec) -> None:
        name = f"lock_{uuid.uuid4().hex[:10]}"
        other = pickle.loads(pickle.dumps(sink.config())).open()
        try:
            sink.unlock(name)  # not held: no error
            assert not other.is_locked(name)
            assert sink.try_lock(name)
            assert other.is_locked(name) and sink.is_locked(name), "is_locked does not see a held lock"
            assert sink.holds_lock(name) and not other.holds_lock(name), "holds_lock: only the holder holds it"
            assert not other.try_lock(name), "a second holder took a held lock"
            assert other.try_lock(name + "_b"), "the lock of another projection is independent"
            other.unlock(name + "_b")
            sink.unlock(name)
            assert not sink.holds_lock(name), "holds_lock after unlock"
            assert not other.is_locked(name), "is_locked still sees a released lock"
            assert other.try_lock(name), "unlock did not release the lock"
            assert not sink.try_lock(name)
        finally:
            other.close()
        # The store releases a closed holder's lock when it notices (PostgreSQL: when the backend of
        # the closed session exits, a moment after the client closed it): a bounded wait.
        deadline = time.monotonic() + 10
        while not sink.try_lock(name):
            assert time.monotonic() < deadline, "close did not release the holder's lock within 10s"
            time.sleep(0.05)
        sink.unlock(name)


def iter_rows(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield contract_row(i, i)


__all__ = ["SinkContract", "contract_row", "contract_view"]
