"""ledger: conflicts as results (no server ERROR), event tags, conditional appends

Revision ID: ledger_0002
Revises: ledger_0001
Create Date: 2026-11-25

1. An optimistic-concurrency conflict is a normal outcome, not an error: the append function
   and procedure return it (``conflict`` jsonb) instead of raising, so the server log does not
   fill with an ERROR and the whole call for every retry. The function (used inside a caller's
   transaction) undoes its own stream-version bumps before returning; the procedure (group
   commit, autocommit CALL) rolls back. Real errors (bad input, a stream type mismatch) still
   raise.
2. Tags: ``events.tags`` (text[], NULL when the event has none) and the index table
   ``event_tags (tag, position) INCLUDE (event_type)``, written in the same transaction as the
   event. A tagged event's content digest appends its tags after the version-1 fields
   (``int4_be(count) || lp(tag)...``, tags sorted by the client); an untagged event hashes
   exactly as in ``ledger_0001``, so existing ledgers verify unchanged.
3. Conditional appends (dynamic consistency boundaries): ``p_condition`` is a JSON array of
   query items ``{"types": [...], "tags": [...]}``; the append fails (result ``conflict``) if an
   event at a position > ``p_after`` matches any item (type among the item's types, or any type
   when none are given; AND every tag of the item). Checked under the ledger lock, after the
   head was read, so the check and the append are atomic. An item with tags costs one probe
   of ``event_tags`` on its first tag from ``p_after`` on, plus one primary-key probe per further
   tag per candidate; an item without tags scans the events after ``p_after``.

Frozen like ``ledger_0001``: a later change is a new revision.
"""

from __future__ import annotations

import os

from alembic import context, op

revision = "ledger_0002"
down_revision = "ledger_0001"
branch_labels = None
depends_on = None

DEFAULT_SCHEMA = "kappaflow_ledger"


def _schema() -> str:
    attrs = getattr(context.config, "attributes", {}) or {}
    return attrs.get("ledger_schema") or os.environ.get("KAPPAFLOW_LEDGER_SCHEMA") or DEFAULT_SCHEMA


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _run(sql: str) -> None:
    op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


def lock_key(schema: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(f"kappaflow.ledger:{schema}".encode()).digest()[:8], "big", signed=True)


_LP = "int4send(octet_length(convert_to({x}, 'UTF8'))) || convert_to({x}, 'UTF8')"
_LPN = "CASE WHEN {x} IS NULL THEN int4send(-1) ELSE " + _LP + " END"
# Tags (NULL -> nothing: an untagged event's digest is the version-1 digest).
_TAGS = ("CASE WHEN {t} IS NULL THEN ''::bytea ELSE int4send(cardinality({t})) || "
         "(SELECT string_agg(int4send(octet_length(convert_to(x.tag, 'UTF8'))) || convert_to(x.tag, 'UTF8'), "
         "''::bytea ORDER BY x.ord) FROM unnest({t}) WITH ORDINALITY AS x(tag, ord)) END")


def _content(stream_id: str, stream_type: str, event_type: str, schema_version: str,
             payload_text: str, metadata_text: str, key: str, tags: str | None) -> str:
    """The content digest; without `tags` the version-1 expression (a PL/pgSQL "simple
    expression": no sub-select, evaluated without the executor)."""
    parts = [_LP.format(x=stream_id), _LP.format(x=stream_type), _LP.format(x=event_type),
             f"int4send({schema_version})", _LP.format(x=payload_text), _LP.format(x=metadata_text),
             _LPN.format(x=key)]
    if tags is not None:
        parts.append(_TAGS.format(t=tags))
    return "sha256(" + " || ".join(parts) + ")"


DDL = r"""
ALTER TABLE {S}.events ADD COLUMN tags text[];

-- One row per (tag, event): the index a condition check probes. event_type is included so a
-- typed query item is decided from the index.
CREATE TABLE {S}.event_tags (
    tag        text NOT NULL,
    position   bigint NOT NULL,
    event_type text NOT NULL,
    CONSTRAINT event_tags_pkey PRIMARY KEY (tag, position) INCLUDE (event_type)
);
CREATE TRIGGER event_tags_immutable BEFORE UPDATE OR DELETE ON {S}.event_tags
    FOR EACH ROW EXECUTE FUNCTION {S}.reject_change();
CREATE TRIGGER event_tags_no_truncate BEFORE TRUNCATE ON {S}.event_tags
    FOR EACH STATEMENT EXECUTE FUNCTION {S}.reject_change();

DROP FUNCTION {S}.append(text[], text[], bigint[], bigint[], integer[], text[], integer[], text[], text[], text,
                         bytea, boolean);
DROP PROCEDURE {S}.append_durable(text[], text[], bigint[], bigint[], integer[], text[], integer[], text[], text[],
                                  text, bytea, bigint, bigint, text[], bigint[], timestamptz, boolean);
"""

# Expected versions: -1 any, -2 no stream, -3 stream exists, >= 0 exact (0 = no events yet).
# Streams arrive sorted by id (rows are locked in that order: no deadlocks); p_ev_stream[i] is
# the 1-based stream index of event i; p_ev_tags[i] is event i's tags as an array literal (or
# NULL), the whole array NULL when no event has tags.
# {UNDO} takes back what the append wrote before it found a conflict: the function undoes its
# stream bumps and its idempotency row (it runs inside the caller's transaction, which goes on);
# the procedure rolls its own transaction back.
APPEND_BODY = r"""
DECLARE
    v_n integer := cardinality(p_ev_types);
    v_k record;
    v_item record;
    v_old bigint[];
    v_new bigint[];
    v_types text[];
    v_seen bigint[];
    v_created boolean[];
    v_done integer := 0;
    v_key_written boolean := false;
    v_dup boolean := false;
    v_conflict jsonb;
    v_ev_version bigint[];
    v_payloads jsonb[];
    v_metadata jsonb[];
    v_digests bytea[];
    v_prev bytea[];
    v_hashes bytea[];
    v_tags text[];
    v_pos bigint;
    v_hit bigint;
    v_hit_type text;
    v_h bytea;
    v_at timestamptz;
    v_micros bigint;
    v_e bigint;
    v_o bigint;
    v_ver bigint;
    v_typ text;
    v_s integer;
    v_item_no integer := 0;
    i integer;
    j integer;{DECLARE}
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'kappaflow ledger: append needs READ COMMITTED isolation, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'KL004';
    END IF;
    {ASYNC}

    <<work>>
    BEGIN
    -- 1. (Idempotency is checked where it costs nothing on the common path: when a stream is not
    --    where the caller expected, and when the key is inserted; a key already committed makes
    --    the call return that append's result, after taking back its own writes.)

    -- 2. Streams in id order: bump the version only where the expectation holds (one statement
    --    per stream on the common path); create new streams. A stream that is not where the
    --    caller expected is a conflict, returned, not raised.
    FOR i IN 1 .. cardinality(p_stream_ids) LOOP
        v_e := p_expected[i];
        v_ver := NULL;
        v_created[i] := false;
        IF v_e <> -2 AND v_e <> 0 THEN  -- any, exists, or an exact version >= 1: the row must exist
            UPDATE {S}.streams s SET version = s.version + p_counts[i], updated_at = now()
            WHERE s.stream_id = p_stream_ids[i] AND (v_e < 0 OR s.version = v_e)
            RETURNING s.version, s.stream_type INTO v_ver, v_typ;
        END IF;
        IF v_ver IS NULL AND (v_e = -1 OR v_e = -2 OR v_e = 0) THEN  -- may (or must) be a new stream
            INSERT INTO {S}.streams AS s (stream_id, stream_type, version)
            VALUES (p_stream_ids[i], p_stream_types[i], p_counts[i])
            ON CONFLICT (stream_id) DO NOTHING
            RETURNING s.version, s.stream_type INTO v_ver, v_typ;
            IF v_ver IS NOT NULL THEN
                v_created[i] := true;
            ELSIF v_e = -1 THEN  -- created concurrently (we waited for its commit): bump it
                UPDATE {S}.streams s SET version = s.version + p_counts[i], updated_at = now()
                WHERE s.stream_id = p_stream_ids[i]
                RETURNING s.version, s.stream_type INTO v_ver, v_typ;
            END IF;
        END IF;
        IF v_ver IS NULL THEN
            IF p_key IS NOT NULL AND EXISTS (SELECT 1 FROM {S}.idempotency_keys k WHERE k.key = p_key) THEN
                -- The stream moved because the append with this key committed (earlier, or
                -- concurrently: we waited for its row lock): return its result.
                v_dup := true;
            ELSE
                SELECT s.version INTO v_o FROM {S}.streams s WHERE s.stream_id = p_stream_ids[i];
                v_conflict := jsonb_build_object('kind', 'version', 'stream_id', p_stream_ids[i],
                                                 'expected', v_e, 'actual', coalesce(v_o, 0));
            END IF;
            EXIT;
        END IF;
        v_done := i;
        v_o := v_ver - p_counts[i];
        v_old[i] := v_o;
        v_new[i] := v_ver;
        v_types[i] := v_typ;
        v_seen[i] := 0;
        IF v_typ <> p_stream_types[i] THEN
            RAISE EXCEPTION 'stream % has type %, not %', p_stream_ids[i], v_typ, p_stream_types[i]
                USING ERRCODE = 'KL003',
                      DETAIL = json_build_object('stream_id', p_stream_ids[i], 'expected', p_stream_types[i],
                                                 'actual', v_typ)::text;
        END IF;
    END LOOP;
    IF v_conflict IS NOT NULL OR v_dup THEN
        {UNDO}
        EXIT work;
    END IF;

    -- 3. Per event: stream version, parsed JSON, content digest -- still outside the ledger lock.
    FOR i IN 1 .. v_n LOOP
        v_s := p_ev_stream[i];
        v_seen[v_s] := v_seen[v_s] + 1;
        v_ev_version[i] := v_old[v_s] + v_seen[v_s];
        v_payloads[i] := p_ev_payloads[i]::jsonb;
        v_metadata[i] := p_ev_metadata[i]::jsonb;
        v_tags := p_ev_tags[i]::text[];
        IF v_tags IS NULL THEN  -- kept apart: the tags' sub-select would make every digest a full query
            v_digests[i] := {CONTENT_V1};
        ELSE
            v_digests[i] := {CONTENT};
        END IF;
    END LOOP;

    -- The idempotency key, also outside the lock: a concurrent append with the same key waits
    -- here for the first one's outcome; if that one committed (or an earlier one did), this one
    -- backs out and returns its result.
    IF p_key IS NOT NULL THEN
        INSERT INTO {S}.idempotency_keys AS k (key, request_hash, stream_id, stream_version, events)
        VALUES (p_key, p_request_hash, p_stream_ids[p_ev_stream[1]], v_ev_version[1], v_n)
        ON CONFLICT (key) DO NOTHING;
        IF NOT FOUND THEN
            v_dup := true;
            {UNDO}
            EXIT work;
        END IF;
        v_key_written := true;
    END IF;

    -- 4. The ledger lock, held until commit: positions are assigned in commit order. The head
    --    is the last committed event (a fresh snapshot: this statement runs after the lock).
    --    Taken by "barging" (see ledger_0001).
    IF NOT pg_try_advisory_xact_lock({LOCK_KEY}) THEN
        FOR j IN 1 .. 20 LOOP
            PERFORM pg_sleep(0.001);
            EXIT WHEN pg_try_advisory_xact_lock({LOCK_KEY});
            IF j = 20 THEN
                PERFORM pg_advisory_xact_lock({LOCK_KEY});
            END IF;
        END LOOP;
    END IF;
    SELECT e.position, e.hash, greatest(clock_timestamp(), e.recorded_at)
    INTO v_pos, v_h, v_at
    FROM {S}.events e ORDER BY e.position DESC LIMIT 1;
    IF NOT FOUND THEN
        v_pos := 0;
        v_h := '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea;
        v_at := clock_timestamp();
    END IF;

    -- 5. The condition, under the lock: every event up to the head is visible, none can commit
    --    meanwhile, so "no matching event after p_after" holds at the moment of the append.
    IF p_condition IS NOT NULL THEN
        IF p_after > v_pos THEN
            RAISE EXCEPTION 'append condition: position % is after the ledger head %', p_after, v_pos
                USING ERRCODE = 'KL006', DETAIL = json_build_object('after', p_after, 'head', v_pos)::text;
        END IF;
        FOR v_item IN SELECT x.types, x.tags FROM jsonb_to_recordset(p_condition) AS x(types text[], tags text[])
        LOOP
            IF coalesce(cardinality(v_item.tags), 0) > 0 THEN
                SELECT t.position, t.event_type INTO v_hit, v_hit_type FROM {S}.event_tags t
                WHERE t.tag = v_item.tags[1] AND t.position > p_after
                  AND (coalesce(cardinality(v_item.types), 0) = 0 OR t.event_type = ANY(v_item.types))
                  AND NOT EXISTS (SELECT 1 FROM unnest(v_item.tags[2:]) AS o(tag)
                                  WHERE NOT EXISTS (SELECT 1 FROM {S}.event_tags t2
                                                    WHERE t2.tag = o.tag AND t2.position = t.position))
                ORDER BY t.position LIMIT 1;
            ELSE
                SELECT e.position, e.event_type INTO v_hit, v_hit_type FROM {S}.events e
                WHERE e.position > p_after
                  AND (coalesce(cardinality(v_item.types), 0) = 0 OR e.event_type = ANY(v_item.types))
                ORDER BY e.position LIMIT 1;
            END IF;
            IF FOUND THEN
                v_conflict := jsonb_build_object('kind', 'condition', 'item', v_item_no, 'position', v_hit,
                                                 'event_type', v_hit_type, 'after', p_after);
                EXIT;
            END IF;
            v_item_no := v_item_no + 1;
        END LOOP;
        IF v_conflict IS NOT NULL THEN
            {UNDO}
            EXIT work;
        END IF;
    END IF;

    v_micros := (extract(epoch FROM v_at) * 1000000)::bigint;
    FOR i IN 1 .. v_n LOOP
        v_prev[i] := v_h;
        v_h := sha256(v_h || int8send(v_pos + i) || int8send(v_ev_version[i]) || int8send(v_micros)
                      || v_digests[i]);
        v_hashes[i] := v_h;
    END LOOP;

    INSERT INTO {S}.events (position, stream_id, stream_type, stream_version, event_type, schema_version,
                            payload, metadata, idempotency_key, recorded_at, prev_hash, hash, tags)
    SELECT v_pos + u.ord, p_stream_ids[u.s], v_types[u.s], u.ver, u.t, u.sv, u.pj, u.mj, p_key, v_at,
           u.pr, u.h, u.tg::text[]
    FROM unnest(p_ev_stream, p_ev_types, p_ev_schema, v_payloads, v_metadata, v_ev_version, v_prev, v_hashes,
                p_ev_tags)
         WITH ORDINALITY AS u(s, t, sv, pj, mj, ver, pr, h, tg, ord);
    IF p_ev_tags IS NOT NULL THEN
        INSERT INTO {S}.event_tags (tag, position, event_type)
        SELECT x.tag, v_pos + u.ord, u.t
        FROM unnest(p_ev_tags, p_ev_types) WITH ORDINALITY AS u(tg, t, ord)
             CROSS JOIN LATERAL unnest(u.tg::text[]) AS x(tag)
        WHERE u.tg IS NOT NULL;
    END IF;

    o_first_position := v_pos + 1;
    o_last_position := v_pos + v_n;
    o_stream_ids := p_stream_ids;
    o_versions := v_new;
    o_recorded_at := v_at;
    o_duplicate := false;
    END work;

    -- A committed append with this key: its result; this call wrote nothing.
    IF v_dup THEN
        SELECT k.request_hash, k.stream_id, k.stream_version, k.events INTO v_k
        FROM {S}.idempotency_keys k WHERE k.key = p_key;
        IF v_k.request_hash <> p_request_hash THEN
            RAISE EXCEPTION 'idempotency key % was already used for a different append', p_key
                USING ERRCODE = 'KL002', DETAIL = json_build_object('key', p_key)::text;
        END IF;
        SELECT e.position INTO v_pos FROM {S}.events e
        WHERE e.stream_id = v_k.stream_id AND e.stream_version = v_k.stream_version;
        SELECT array_agg(t.stream_id ORDER BY t.stream_id), array_agg(t.v ORDER BY t.stream_id), min(t.at)
        INTO o_stream_ids, o_versions, o_recorded_at
        FROM (SELECT e.stream_id, max(e.stream_version) AS v, min(e.recorded_at) AS at
              FROM {S}.events e WHERE e.position BETWEEN v_pos AND v_pos + v_k.events - 1
              GROUP BY e.stream_id) t;
        o_first_position := v_pos;
        o_last_position := v_pos + v_k.events - 1;
        o_duplicate := true;
    END IF;
    o_conflict := v_conflict;

    {TAIL}
END
"""

_UNDO_FUNCTION = """-- the caller's transaction goes on: take back this call's writes
        FOR j IN 1 .. v_done LOOP
            IF v_created[j] THEN
                DELETE FROM {S}.streams WHERE stream_id = p_stream_ids[j];
            ELSE
                UPDATE {S}.streams SET version = version - p_counts[j] WHERE stream_id = p_stream_ids[j];
            END IF;
        END LOOP;
        IF v_key_written THEN
            DELETE FROM {S}.idempotency_keys WHERE key = p_key;
        END IF;"""

_PARAMS = """p_stream_ids text[], p_stream_types text[], p_expected bigint[], p_counts bigint[],
    p_ev_stream integer[], p_ev_types text[], p_ev_schema integer[], p_ev_payloads text[],
    p_ev_metadata text[], p_ev_tags text[], p_key text, p_request_hash bytea, p_condition jsonb, p_after bigint"""

APPEND_FUNCTION = """
CREATE FUNCTION {S}.append(
    """ + _PARAMS + """, p_group_commit boolean)
RETURNS TABLE (first_position bigint, last_position bigint, stream_ids text[], versions bigint[],
               recorded_at timestamptz, duplicate boolean, conflict jsonb)
LANGUAGE plpgsql
AS $fn$""" + APPEND_BODY.replace("{DECLARE}", """
    o_first_position bigint;
    o_last_position bigint;
    o_stream_ids text[];
    o_versions bigint[];
    o_recorded_at timestamptz;
    o_duplicate boolean;
    o_conflict jsonb;""").replace("{ASYNC}", """IF p_group_commit THEN
        -- Commit without waiting for the WAL flush (the caller then runs a durability barrier).
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;""").replace("{UNDO}", _UNDO_FUNCTION).replace("{TAIL}", """first_position := o_first_position;
    last_position := o_last_position;
    stream_ids := o_stream_ids;
    versions := o_versions;
    recorded_at := o_recorded_at;
    duplicate := o_duplicate;
    conflict := o_conflict;
    RETURN NEXT;""") + "$fn$;\n"

# Group commit in ONE round trip (see ledger_0001): the append commits asynchronously, then the
# durability barrier commits synchronously. A conflict rolls back and returns (no barrier: nothing
# was written).
APPEND_PROCEDURE = """
CREATE PROCEDURE {S}.append_durable(
    """ + _PARAMS + """,
    INOUT o_first_position bigint DEFAULT NULL, INOUT o_last_position bigint DEFAULT NULL,
    INOUT o_stream_ids text[] DEFAULT NULL, INOUT o_versions bigint[] DEFAULT NULL,
    INOUT o_recorded_at timestamptz DEFAULT NULL, INOUT o_duplicate boolean DEFAULT NULL,
    INOUT o_conflict jsonb DEFAULT NULL)
LANGUAGE plpgsql
AS $fn$""" + APPEND_BODY.replace("{DECLARE}", "").replace(
    "{ASYNC}", "PERFORM set_config('synchronous_commit', 'off', true);").replace(
    "{UNDO}", "ROLLBACK;").replace("{TAIL}", """IF o_conflict IS NULL THEN
        COMMIT;
        INSERT INTO {S}.durability_barrier AS b (pid, n) VALUES (pg_backend_pid(), 1)
        ON CONFLICT (pid) DO UPDATE SET n = b.n + 1;
    END IF;""") + "$fn$;\n"


def upgrade() -> None:
    s = _quote(_schema())
    args = ("p_stream_ids[v_s]", "v_types[v_s]", "p_ev_types[i]", "p_ev_schema[i]", "v_payloads[i]::text",
            "v_metadata[i]::text", "p_key")
    _run(DDL.replace("{S}", s))
    for ddl in (APPEND_FUNCTION, APPEND_PROCEDURE):
        _run(ddl.replace("{S}", s).replace("{CONTENT_V1}", _content(*args, None))
             .replace("{CONTENT}", _content(*args, "v_tags")).replace("{LOCK_KEY}", str(lock_key(_schema()))))


def downgrade() -> None:
    raise NotImplementedError("ledger_0002 has no downgrade: tagged events cannot be expressed in ledger_0001")
