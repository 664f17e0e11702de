"""The hash chain: its encoding, and verification that names the first bad position.

Encoding (fixed by the migrations ``ledger_0001`` and ``ledger_0002``)::

    lp(s)    = int4_be(len(utf8(s))) || utf8(s)          (NULL -> int4_be(-1))
    content  = sha256(lp(stream_id) || lp(stream_type) || lp(event_type) || int4_be(schema_version)
                      || lp(payload::text) || lp(metadata::text) || lp(idempotency_key)
                      || tags)
    tags     = ''  for an event without tags (so untagged events hash as in ledger_0001), else
               int4_be(count) || lp(tag_1) || ... || lp(tag_n)   (tags sorted, as stored)
    hash(p)  = sha256(hash(p-1) || int8_be(p) || int8_be(stream_version)
                      || int8_be(recorded_at in epoch microseconds) || content)
    hash(0)  = 32 zero bytes

``payload::text`` is PostgreSQL's canonical jsonb text, so the stored row alone determines its
hash. Verification recomputes every hash in the database (set-based, chunked by position),
checks that ``prev_hash`` links each row to its predecessor, that positions are dense from 1,
and that every stream's versions run 1..n in position order and match ``streams.version`` (which
also catches events cut off the end, or appended with a forged but self-consistent chain). That
detects an edited, removed, inserted or reordered row. A superuser who rewrites the chain suffix
*and* the streams table is only caught against an external anchor: keep ``(position, hash)``
pairs from `kappaflow ledger stats` elsewhere and pass them as `anchors`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

GENESIS_HASH = bytes(32)

_LP = "int4send(octet_length(convert_to({x}, 'UTF8'))) || convert_to({x}, 'UTF8')"
_LPN = "CASE WHEN {x} IS NULL THEN int4send(-1) ELSE " + _LP + " END"
_TAGS = ("CASE WHEN {t} IS NULL THEN ''::bytea ELSE int4send(cardinality({t})) || "
         "(SELECT string_agg(int4send(octet_length(convert_to(x.tag, 'UTF8'))) || convert_to(x.tag, 'UTF8'), "
         "''::bytea ORDER BY x.ord) FROM unnest({t}) WITH ORDINALITY AS x(tag, ord)) END")


def content_sql(stream_id: str, stream_type: str, event_type: str, schema_version: str,
                payload_text: str, metadata_text: str, key: str, tags: str) -> str:
    """The SQL expression for an event's content digest (same text as in ledger_0002)."""
    return "sha256(" + " || ".join([
        _LP.format(x=stream_id), _LP.format(x=stream_type), _LP.format(x=event_type),
        f"int4send({schema_version})", _LP.format(x=payload_text), _LP.format(x=metadata_text),
        _LPN.format(x=key), _TAGS.format(t=tags),
    ]) + ")"


_ROW_HASH_SQL = (
    "sha256(e.prev_hash || int8send(e.position) || int8send(e.stream_version) "
    "|| int8send((extract(epoch from e.recorded_at) * 1000000)::bigint) || "
    + content_sql("e.stream_id", "e.stream_type", "e.event_type", "e.schema_version", "e.payload::text",
                  "e.metadata::text", "e.idempotency_key", "e.tags")
    + ")"
)


def _lp(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">i", -1)
    b = s.encode("utf-8")
    return struct.pack(">i", len(b)) + b


def event_hash(prev_hash: bytes, position: int, stream_version: int, recorded_at_micros: int,
               stream_id: str, stream_type: str, event_type: str, schema_version: int,
               payload_text: str, metadata_text: str, idempotency_key: str | None,
               tags: Sequence[str] | None = None) -> bytes:
    """The reference implementation of the encoding above (independent of the SQL)."""
    tag_bytes = b"" if tags is None else struct.pack(">i", len(tags)) + b"".join(_lp(t) for t in tags)
    content = hashlib.sha256(
        _lp(stream_id) + _lp(stream_type) + _lp(event_type) + struct.pack(">i", schema_version)
        + _lp(payload_text) + _lp(metadata_text) + _lp(idempotency_key) + tag_bytes).digest()
    return hashlib.sha256(prev_hash + struct.pack(">qqq", position, stream_version, recorded_at_micros)
                          + content).digest()


@dataclass(frozen=True, slots=True)
class VerifyReport:
    ok: bool
    checked: int  # rows whose hash was recomputed
    head_position: int
    first_bad_position: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "checked": self.checked, "head_position": self.head_position,
                "first_bad_position": self.first_bad_position, "reason": self.reason}


def verify(conn: psycopg.Connection, schema: str, *, from_position: int = 1, chunk: int = 50_000,
           anchors: Sequence[tuple[int, bytes]] = (),
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Verify the ledger in `schema`; the report names the first bad position and why.

    `from_position` > 1 trusts the rows before it (their hash is taken as given).
    """
    events = sql.Identifier(schema, "events")
    streams = sql.Identifier(schema, "streams")
    max_row = conn.execute(sql.SQL("select max(position) from {}").format(events)).fetchone()
    head_pos = end = int(max_row[0]) if max_row and max_row[0] is not None else 0

    problems: list[tuple[int, str]] = []
    chunk_sql = sql.SQL(
        "with e as (select e.position, e.prev_hash, e.hash, " + _ROW_HASH_SQL + " as computed, "
        "lag(e.position) over (order by e.position) as lag_pos, "
        "lag(e.hash) over (order by e.position) as lag_hash "
        "from {events} e where e.position >= %(lo)s and e.position <= %(hi)s) "
        "select position, prev_hash, hash, computed, lag_pos, lag_hash from e "
        "where position >= %(start)s and (computed <> hash or (lag_pos is null and position > 1) "
        "or lag_pos <> position - 1 or lag_hash <> prev_hash) order by position limit 1"
    ).format(events=events)
    checked = 0
    start = max(1, from_position)
    if start == 1 and end > 0:
        first = conn.execute(sql.SQL("select position, prev_hash from {} order by position limit 1").format(
            events)).fetchone()
        if first is None or first[0] != 1:
            problems.append((1, "position 1 is missing (the first event was removed)"))
        elif bytes(first[1]) != GENESIS_HASH:
            problems.append((1, "position 1 does not start from the genesis hash"))
    lo = start
    while lo <= end and not problems:
        hi = min(end, lo + chunk - 1)
        bad = conn.execute(chunk_sql, {"lo": max(1, lo - 1), "hi": hi, "start": lo}).fetchone()
        n = conn.execute(sql.SQL("select count(*) from {} where position between %s and %s").format(events),
                         (lo, hi)).fetchone()
        checked += int(n[0]) if n else 0
        if bad is not None:
            pos, prev_hash, hash_, computed, lag_pos, lag_hash = bad
            if lag_pos is None and pos > 1:
                before = conn.execute(sql.SQL("select max(position) from {} where position < %s").format(
                    events), (pos,)).fetchone()
                missing = (int(before[0]) if before and before[0] is not None else 0) + 1
                problems.append((missing, f"position {missing} is missing (removed row; the next present "
                                          f"position is {pos})"))
            elif lag_pos is not None and lag_pos != pos - 1:
                problems.append((lag_pos + 1, f"position {lag_pos + 1} is missing (removed row; "
                                              f"the next present position is {pos})"))
            elif bytes(computed) != bytes(hash_):
                problems.append((pos, f"position {pos}: the row's content does not match its hash "
                                      "(altered or forged row)"))
            elif lag_hash is not None and bytes(lag_hash) != bytes(prev_hash):
                problems.append((pos, f"position {pos}: prev_hash does not link to position {pos - 1} "
                                      "(inserted, replaced or reordered row)"))
        if progress is not None:
            progress(hi, end)
        lo = hi + 1

    # Streams: versions 1..n in position order, matching streams.version.
    if not problems:
        bad_stream = conn.execute(sql.SQL(
            "select min(position) from (select position, stream_version, "
            "row_number() over (partition by stream_id order by position) as rn "
            "from {events} where position >= %s) s where stream_version <> rn").format(events=events),
            (1,)).fetchone()
        if bad_stream and bad_stream[0] is not None:
            problems.append((int(bad_stream[0]), f"position {bad_stream[0]}: stream versions out of order "
                                                 "or with a gap"))
        mismatches = conn.execute(sql.SQL(
            "select stream_id, coalesce(s.version, 0), coalesce(e.v, 0) from {streams} s "
            "full join (select stream_id, max(stream_version) as v from {events} group by stream_id) e "
            "using (stream_id) where coalesce(s.version, 0) <> coalesce(e.v, 0) limit 100"
        ).format(streams=streams, events=events)).fetchall()
        for sid, sver, ever in mismatches:
            if sver > ever:  # the chain is intact, so the stream's missing events were cut off the end
                at, what = head_pos + 1, "events were removed from the end of the ledger"
            else:
                first = conn.execute(sql.SQL(
                    "select min(position) from {} where stream_id = %s and stream_version > %s").format(events),
                    (sid, sver)).fetchone()
                at, what = int(first[0]) if first and first[0] else 1, "events were inserted"
            problems.append((at, f"stream {sid!r}: streams.version is {sver} but its events end at version "
                                 f"{ever} ({what})"))

    for pos, expected in anchors:
        got = conn.execute(sql.SQL("select hash from {} where position = %s").format(events), (pos,)).fetchone()
        if got is None or bytes(got[0]) != expected:
            problems.append((pos, f"position {pos}: hash differs from the external anchor"))

    if problems:
        pos, reason = min(problems, key=lambda p: p[0])
        return VerifyReport(False, checked, head_pos, pos, reason)
    return VerifyReport(True, checked, head_pos)
