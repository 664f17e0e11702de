"""ledger: streams, events (hash-chained, immutable), idempotency keys, append()

Revision ID: ledger_0001
Revises:
Create Date: 2026-11-22

The schema name comes from the Alembic config attribute ``ledger_schema`` (set by
``kappaflow.ledger.install(dsn, schema=...)``), else the environment variable
``KAPPAFLOW_LEDGER_SCHEMA``, else ``kappaflow_ledger``. It is always quoted.

This revision is frozen: the hash-chain encoding below must never change here (a later
revision may add a new encoding version). ``kappaflow.ledger.hashing`` holds the same
encoding for verification and a test checks the two agree.
"""

from __future__ import annotations

import os

from alembic import context, op

revision = "ledger_0001"
down_revision = None
branch_labels = ("ledger",)
depends_on = None

DEFAULT_SCHEMA = "kappaflow_ledger"


def _schema() -> str:
    attrs = getattr(context.config, "attributes", {}) or {}
    return attrs.get("ledger_schema") or os.environ.get("KAPPAFLOW_LEDGER_SCHEMA") or DEFAULT_SCHEMA


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _run(sql: str) -> None:
    # The raw driver connection (psycopg 3) inside Alembic's transaction: no bind-parameter
    # parsing, so ':' and '%' in function bodies pass through untouched.
    op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


# Length-prefixed UTF-8 text; NULL encodes as length -1. Used for the content digest.
_LP = "int4send(octet_length(convert_to({x}, 'UTF8'))) || convert_to({x}, 'UTF8')"
_LPN = "CASE WHEN {x} IS NULL THEN int4send(-1) ELSE " + _LP + " END"


def _content(stream_id: str, stream_type: str, event_type: str, schema_version: str,
             payload_text: str, metadata_text: str, key: str) -> str:
    return "sha256(" + " || ".join([
        _LP.format(x=stream_id), _LP.format(x=stream_type), _LP.format(x=event_type),
        f"int4send({schema_version})", _LP.format(x=payload_text), _LP.format(x=metadata_text),
        _LPN.format(x=key),
    ]) + ")"


DDL = r"""
CREATE SCHEMA IF NOT EXISTS {S};

CREATE TABLE {S}.streams (
    stream_id   text PRIMARY KEY CHECK (stream_id <> ''),
    stream_type text NOT NULL CHECK (stream_type <> ''),
    version     bigint NOT NULL CHECK (version >= 0),
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- position is the primary key (and the capture key for the PostgreSQL connector);
-- REPLICA IDENTITY stays DEFAULT: rows are insert-only.
CREATE TABLE {S}.events (
    position        bigint PRIMARY KEY CHECK (position > 0),
    stream_id       text NOT NULL,
    stream_type     text NOT NULL,
    stream_version  bigint NOT NULL CHECK (stream_version > 0),
    event_type      text NOT NULL,
    schema_version  integer NOT NULL CHECK (schema_version > 0),
    payload         jsonb NOT NULL,
    metadata        jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    idempotency_key text,
    recorded_at     timestamptz NOT NULL,
    prev_hash       bytea NOT NULL,
    hash            bytea NOT NULL,
    CONSTRAINT events_stream_version_key UNIQUE (stream_id, stream_version)
);

-- The append's first event is (stream_id, stream_version); its positions are that event's
-- position .. + events - 1. Known before positions are assigned, so the row is written outside
-- the ledger lock.
CREATE TABLE {S}.idempotency_keys (
    key            text PRIMARY KEY,
    request_hash   bytea NOT NULL,
    stream_id      text NOT NULL,
    stream_version bigint NOT NULL,
    events         integer NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
);

-- Group commit: an append commits without waiting for the WAL flush (so the ledger lock is not
-- held across an fsync), then the client writes its row here with a synchronous commit, which
-- flushes the WAL up to and including the append. One row per backend: no contention.
CREATE TABLE {S}.durability_barrier (
    pid integer PRIMARY KEY,
    n   bigint NOT NULL
);

CREATE FUNCTION {S}.reject_change() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'kappaflow ledger: % on %.% is not allowed: %', TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME,
        'events are immutable (append a compensating event instead)'
        USING ERRCODE = 'KL010';
END
$fn$;
CREATE TRIGGER events_immutable BEFORE UPDATE OR DELETE ON {S}.events
    FOR EACH ROW EXECUTE FUNCTION {S}.reject_change();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON {S}.events
    FOR EACH STATEMENT EXECUTE FUNCTION {S}.reject_change();
"""

# Expected versions: -1 any, -2 no stream, -3 stream exists, >= 0 exact (0 = no events yet).
# The client sends streams sorted by id (rows are locked in that order: no deadlocks between
# appends touching the same streams); p_ev_stream[i] is the 1-based stream index of event i.
# Few SQL statements on purpose: in PL/pgSQL each one costs an executor start-up, and the
# statements after the ledger lock are the serial section of every append.
# One body, two wrappers: the function `append` (inside a caller's transaction, or with a
# synchronous commit) and the procedure `append_durable` (group commit, see below). Table names
# are schema-qualified because a procedure that commits may not carry a SET search_path clause.
APPEND_BODY = r"""
DECLARE
    v_n integer := cardinality(p_ev_types);
    v_k record;
    v_old bigint[];
    v_new bigint[];
    v_types text[];
    v_seen bigint[];
    v_ev_version bigint[];
    v_payloads jsonb[];
    v_metadata jsonb[];
    v_digests bytea[];
    v_prev bytea[];
    v_hashes bytea[];
    v_pos bigint;
    v_h bytea;
    v_at timestamptz;
    v_micros bigint;
    v_e bigint;
    v_o bigint;
    v_ver bigint;
    v_typ text;
    v_s integer;
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
    -- 1. Idempotency: a committed append with this key -> its result; nothing is written.
    IF p_key IS NOT NULL THEN
        SELECT k.request_hash, k.stream_id, k.stream_version, k.events INTO v_k
        FROM {S}.idempotency_keys k WHERE k.key = p_key;
        IF FOUND THEN
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
            EXIT work;
        END IF;
    END IF;

    -- 2. Streams in id order: create, or lock and bump the version; check the expectations.
    --    (One UPDATE per stream is cheaper than one INSERT ... ON CONFLICT for all of them.)
    FOR i IN 1 .. cardinality(p_stream_ids) LOOP
        UPDATE {S}.streams s SET version = s.version + p_counts[i], updated_at = now()
        WHERE s.stream_id = p_stream_ids[i]
        RETURNING s.version, s.stream_type INTO v_ver, v_typ;
        IF NOT FOUND THEN  -- a new stream (or one created concurrently: then this updates it)
            INSERT INTO {S}.streams AS s (stream_id, stream_type, version)
            VALUES (p_stream_ids[i], p_stream_types[i], p_counts[i])
            ON CONFLICT (stream_id) DO UPDATE SET version = s.version + excluded.version, updated_at = now()
            RETURNING s.version, s.stream_type INTO v_ver, v_typ;
        END IF;
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
        v_e := p_expected[i];
        IF NOT (v_e = -1 OR (v_e = -2 AND v_o = 0) OR (v_e = -3 AND v_o > 0) OR v_e = v_o) THEN
            IF p_key IS NOT NULL AND EXISTS (SELECT 1 FROM {S}.idempotency_keys k WHERE k.key = p_key) THEN
                -- The stream moved because a concurrent append with the same key committed (we
                -- waited for its row lock): roll back; the client's retry returns its result.
                RAISE EXCEPTION 'idempotency key % committed concurrently', p_key USING ERRCODE = 'KL005';
            END IF;
            RAISE EXCEPTION 'wrong expected version for stream %: expected %, found %',
                p_stream_ids[i],
                CASE v_e WHEN -2 THEN 'no stream' WHEN -3 THEN 'an existing stream' ELSE v_e::text END,
                v_o
                USING ERRCODE = 'KL001',
                      DETAIL = json_build_object('stream_id', p_stream_ids[i], 'expected', v_e,
                                                 'actual', v_o)::text;
        END IF;
    END LOOP;

    -- 3. Per event: stream version, parsed JSON, content digest -- still outside the ledger lock.
    FOR i IN 1 .. v_n LOOP
        v_s := p_ev_stream[i];
        v_seen[v_s] := v_seen[v_s] + 1;
        v_ev_version[i] := v_old[v_s] + v_seen[v_s];
        v_payloads[i] := p_ev_payloads[i]::jsonb;
        v_metadata[i] := p_ev_metadata[i]::jsonb;
        v_digests[i] := {CONTENT};
    END LOOP;

    -- The idempotency key, also outside the lock: a concurrent append with the same key waits
    -- here for the first one's outcome, then rolls back (the client's retry finds the key).
    -- The row names the append's first event; its positions follow from that event's.
    IF p_key IS NOT NULL THEN
        INSERT INTO {S}.idempotency_keys AS k (key, request_hash, stream_id, stream_version, events)
        VALUES (p_key, p_request_hash, p_stream_ids[p_ev_stream[1]], v_ev_version[1], v_n)
        ON CONFLICT (key) DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'idempotency key % committed concurrently', p_key USING ERRCODE = 'KL005';
        END IF;
    END IF;

    -- 4. The ledger lock, held until commit: positions are assigned in commit order. The head
    --    is the last committed event (a fresh snapshot: this statement runs after the lock).
    --    Taken by "barging": try, and while it is held, sleep 1 ms and try again (a bounded
    --    number of times, then queue). A queued waiter is granted the lock at release and holds
    --    it while it wakes up; on a busy machine that wake-up takes longer than the whole critical
    --    section, so a FIFO queue (lock convoy) halves throughput. Barging hands the lock to a
    --    session that is running. Correctness is the same either way.
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
    v_micros := (extract(epoch FROM v_at) * 1000000)::bigint;
    FOR i IN 1 .. v_n LOOP
        v_prev[i] := v_h;
        v_h := sha256(v_h || int8send(v_pos + i) || int8send(v_ev_version[i]) || int8send(v_micros)
                      || v_digests[i]);
        v_hashes[i] := v_h;
    END LOOP;

    INSERT INTO {S}.events (position, stream_id, stream_type, stream_version, event_type, schema_version,
                            payload, metadata, idempotency_key, recorded_at, prev_hash, hash)
    SELECT v_pos + u.ord, p_stream_ids[u.s], v_types[u.s], u.ver, u.t, u.sv, u.pj, u.mj, p_key, v_at,
           u.pr, u.h
    FROM unnest(p_ev_stream, p_ev_types, p_ev_schema, v_payloads, v_metadata, v_ev_version, v_prev, v_hashes)
         WITH ORDINALITY AS u(s, t, sv, pj, mj, ver, pr, h, ord);

    o_first_position := v_pos + 1;
    o_last_position := v_pos + v_n;
    o_stream_ids := p_stream_ids;
    o_versions := v_new;
    o_recorded_at := v_at;
    o_duplicate := false;
    END work;

    {TAIL}
END
"""

_PARAMS = """p_stream_ids text[], p_stream_types text[], p_expected bigint[], p_counts bigint[],
    p_ev_stream integer[], p_ev_types text[], p_ev_schema integer[], p_ev_payloads text[],
    p_ev_metadata text[], p_key text, p_request_hash bytea"""

APPEND_FUNCTION = """
CREATE FUNCTION {S}.append(
    """ + _PARAMS + """, p_group_commit boolean)
RETURNS TABLE (first_position bigint, last_position bigint, stream_ids text[], versions bigint[],
               recorded_at timestamptz, duplicate boolean)
LANGUAGE plpgsql
AS $fn$""" + APPEND_BODY.replace("{DECLARE}", """
    o_first_position bigint;
    o_last_position bigint;
    o_stream_ids text[];
    o_versions bigint[];
    o_recorded_at timestamptz;
    o_duplicate boolean;""").replace("{ASYNC}", """IF p_group_commit THEN
        -- Commit without waiting for the WAL flush (the caller then runs a durability barrier).
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;""").replace("{TAIL}", """first_position := o_first_position;
    last_position := o_last_position;
    stream_ids := o_stream_ids;
    versions := o_versions;
    recorded_at := o_recorded_at;
    duplicate := o_duplicate;
    RETURN NEXT;""") + "$fn$;\n"

# Group commit in ONE round trip. The append commits asynchronously (the ledger lock is released
# without waiting for the fsync); then the durability barrier commits synchronously, and its flush
# covers the append's commit record; concurrent callers share fsyncs. Also for a duplicate: the
# original append may not be flushed yet. CALL it outside a transaction block (autocommit), else
# PostgreSQL refuses the COMMIT.
APPEND_PROCEDURE = """
CREATE PROCEDURE {S}.append_durable(
    """ + _PARAMS + """,
    INOUT o_first_position bigint DEFAULT NULL, INOUT o_last_position bigint DEFAULT NULL,
    INOUT o_stream_ids text[] DEFAULT NULL, INOUT o_versions bigint[] DEFAULT NULL,
    INOUT o_recorded_at timestamptz DEFAULT NULL, INOUT o_duplicate boolean DEFAULT NULL)
LANGUAGE plpgsql
AS $fn$""" + APPEND_BODY.replace("{DECLARE}", "").replace(
    "{ASYNC}", "PERFORM set_config('synchronous_commit', 'off', true);").replace("{TAIL}", """COMMIT;
    INSERT INTO {S}.durability_barrier AS b (pid, n) VALUES (pg_backend_pid(), 1)
    ON CONFLICT (pid) DO UPDATE SET n = b.n + 1;""") + "$fn$;\n"


def lock_key(schema: str) -> int:
    """The advisory lock key that serialises position assignment for one ledger schema."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"kappaflow.ledger:{schema}".encode()).digest()[:8], "big", signed=True)


def upgrade() -> None:
    s = _quote(_schema())
    content = _content("p_stream_ids[v_s]", "v_types[v_s]", "p_ev_types[i]", "p_ev_schema[i]",
                       "v_payloads[i]::text", "v_metadata[i]::text", "p_key")
    _run(DDL.format(S=s))
    for ddl in (APPEND_FUNCTION, APPEND_PROCEDURE):
        _run(ddl.replace("{S}", s).replace("{CONTENT}", content).replace("{LOCK_KEY}", str(lock_key(_schema()))))


def downgrade() -> None:
    # Destroys the ledger's data: only for throwaway databases.
    _run(f"DROP SCHEMA IF EXISTS {_quote(_schema())} CASCADE")
