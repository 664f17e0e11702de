"""Following the ledger in global order without ever skipping an event.

Positions are dense and assigned in commit order (see `kappaflow.ledger.store`), so reading
``position >= next`` is gap-safe by construction. The reader still keeps a safety net: it
delivers only the contiguous run starting at its next position; a hole (only possible if a
row was removed behind the database's back) stops it there, and a hole that persists for
`hole_timeout` seconds raises `CorruptLedgerError` naming the missing position instead of
silently moving past it.

With group commit an append is visible a moment before its WAL is flushed; the reader runs a
durability barrier before delivering a batch (`durable=True`), so it never hands out an event a
server crash could still take back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from kappaflow.ledger.errors import CorruptLedgerError, InvalidAppendError
from kappaflow.ledger.events import RecordedEvent
from kappaflow.ledger.store import Ledger


class TailReader:
    """Reads batches from `next_position` on; `next_position` is the resume state to persist."""

    def __init__(self, ledger: Ledger, *, next_position: int = 1, batch: int = 1000,
                 stream_types: Sequence[str] | None = None, decode: bool = True,
                 hole_timeout: float = 5.0, durable: bool = True, hashes: bool = False,
                 reveal: bool = True) -> None:
        if not isinstance(next_position, int) or isinstance(next_position, bool) or next_position < 1:
            raise InvalidAppendError(f"expected an integer >= 1, got {next_position!r}", field="next_position")
        self.ledger = ledger
        self.next_position = next_position
        self.batch = batch
        self.stream_types = set(stream_types) if stream_types else None
        self.decode = decode
        self.hole_timeout = hole_timeout
        self.durable = durable
        self.hashes = hashes
        self.reveal = reveal
        self._hole_since: float | None = None

    def poll(self, timeout: float = 0.0, *, interval: float = 0.02) -> list[RecordedEvent]:
        """The next contiguous batch (possibly filtered by stream type); waits up to `timeout` s
        for events to appear, returns [] if none did."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.ledger.read_all(from_position=self.next_position, limit=self.batch, decode=False,
                                        hashes=self.hashes, reveal=self.reveal)
            run: list[RecordedEvent] = []
            expect = self.next_position
            for r in rows:
                if r.position != expect:
                    break
                run.append(r)
                expect += 1
            if run:
                if self.durable:
                    self.ledger.barrier()  # everything we read is on disk before anyone sees it
                self._hole_since = None
                self.next_position = expect
                out = [r for r in run if self.stream_types is None or r.stream_type in self.stream_types]
                if out:
                    return self._decode(out)
                continue  # a whole batch of other stream types: read on
            if rows:  # something exists beyond a hole
                now = time.monotonic()
                self._hole_since = self._hole_since or now
                if now - self._hole_since >= self.hole_timeout:
                    raise CorruptLedgerError(
                        f"ledger position {self.next_position} is missing while position {rows[0].position} "
                        "exists; a row was removed (run `kappaflow ledger verify`)",
                        position=self.next_position)
            if time.monotonic() >= deadline:
                return []
            time.sleep(interval)

    def __iter__(self) -> Iterator[RecordedEvent]:
        """Every event from `next_position` on, forever (blocks while the ledger is idle)."""
        while True:
            yield from self.poll(timeout=1.0)

    def _decode(self, rows: list[RecordedEvent]) -> list[RecordedEvent]:
        registry = self.ledger.registry
        if not self.decode or registry is None:
            return rows
        from dataclasses import replace

        return [replace(r, event=registry.decode(r.event_type, r.schema_version, r.data, position=r.position))
                for r in rows]
