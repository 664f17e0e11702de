"""ledger: streams, events (hash-chained, immutable), head, idempotency keys, append()

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
CREATE INDEX events_stream_type_position ON {S}.events (stream_type, position);

-- The single row every append locks last: it serialises position assignment so that
-- positions are dense and in commit order, and carries the chain head.
CREATE TABLE {S}.head (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    position    bigint NOT NULL,
    hash        bytea NOT NULL,
    recorded_at timestamptz
);
INSERT INTO {S}.head (singleton, position, hash, recorded_at)
VALUES (true, 0, '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea, NULL);

CREATE TABLE {S}.idempotency_keys (
    key            text PRIMARY KEY,
    request_hash   bytea NOT NULL,
    first_position bigint,
    last_position  bigint,
    created_at     timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION {S}.reject_change() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'kappaflow ledger: % on %.% is not allowed: events are immutable (append a compensating event instead)',
        TG_OP, TG_TABLE_SCHEMA, TG_TABLE_NAME
        USING ERRCODE = 'KL010';
END
$fn$;
CREATE TRIGGER events_immutable BEFORE UPDATE OR DELETE ON {S}.events
    FOR EACH ROW EXECUTE FUNCTION {S}.reject_change();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON {S}.events
    FOR EACH STATEMENT EXECUTE FUNCTION {S}.reject_change();
CREATE TRIGGER head_no_delete BEFORE DELETE OR TRUNCATE ON {S}.head
    FOR EACH STATEMENT EXECUTE FUNCTION {S}.reject_change();
"""

# Expected versions: -1 any, -2 no stream, -3 stream exists, >= 0 exact (0 = no events yet).
APPEND = r"""
CREATE FUNCTION {S}.append(
    p_stream_ids text[], p_stream_types text[], p_expected bigint[], p_counts bigint[],
    p_ev_stream integer[], p_ev_types text[], p_ev_schema integer[], p_ev_payloads text[],
    p_ev_metadata text[], p_key text, p_request_hash bytea)
RETURNS TABLE (first_position bigint, last_position bigint, stream_ids text[], versions bigint[],
               recorded_at timestamptz, duplicate boolean)
LANGUAGE plpgsql
SET search_path = {S}, pg_temp
AS $fn$
DECLARE
    v_n integer := cardinality(p_ev_types);
    v_k record;
    v_old bigint[];
    v_new bigint[];
    v_types text[];
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
    i integer;
BEGIN
    -- 1. Idempotency: a concurrent append with the same key waits here for the first one.
    IF p_key IS NOT NULL THEN
        INSERT INTO idempotency_keys AS k (key, request_hash) VALUES (p_key, p_request_hash)
        ON CONFLICT (key) DO NOTHING;
        IF NOT FOUND THEN
            SELECT * INTO v_k FROM idempotency_keys k WHERE k.key = p_key;
            IF v_k.request_hash <> p_request_hash THEN
                RAISE EXCEPTION 'idempotency key % was already used for a different append', p_key
                    USING ERRCODE = 'KL002', DETAIL = json_build_object('key', p_key)::text;
            END IF;
            RETURN QUERY
                SELECT v_k.first_position, v_k.last_position,
                       array_agg(t.stream_id ORDER BY t.stream_id), array_agg(t.v ORDER BY t.stream_id),
                       min(t.at), true
                FROM (SELECT e.stream_id, max(e.stream_version) AS v, min(e.recorded_at) AS at
                      FROM events e WHERE e.position BETWEEN v_k.first_position AND v_k.last_position
                      GROUP BY e.stream_id) t;
            RETURN;
        END IF;
    END IF;

    -- 2. Lock (or create) every stream in id order, bumping its version; one statement, no deadlock
    --    between appends that touch the same streams.
    WITH input AS (
        SELECT u.id, u.typ, u.cnt, u.ord
        FROM unnest(p_stream_ids, p_stream_types, p_counts) WITH ORDINALITY AS u(id, typ, cnt, ord)
    ), up AS (
        INSERT INTO streams AS s (stream_id, stream_type, version)
        SELECT input.id, input.typ, input.cnt FROM input ORDER BY input.id
        ON CONFLICT (stream_id) DO UPDATE SET version = s.version + excluded.version, updated_at = now()
        RETURNING s.stream_id, s.stream_type, s.version
    )
    SELECT array_agg(up.version - input.cnt ORDER BY input.ord), array_agg(up.version ORDER BY input.ord),
           array_agg(up.stream_type ORDER BY input.ord)
    INTO v_old, v_new, v_types
    FROM input JOIN up ON up.stream_id = input.id;

    -- 3. Check expected versions and stream types.
    FOR i IN 1 .. cardinality(p_stream_ids) LOOP
        IF v_types[i] <> p_stream_types[i] THEN
            RAISE EXCEPTION 'stream % has type %, not %', p_stream_ids[i], v_types[i], p_stream_types[i]
                USING ERRCODE = 'KL003',
                      DETAIL = json_build_object('stream_id', p_stream_ids[i], 'expected', p_stream_types[i],
                                                 'actual', v_types[i])::text;
        END IF;
        v_e := p_expected[i];
        v_o := v_old[i];
        IF NOT (v_e = -1 OR (v_e = -2 AND v_o = 0) OR (v_e = -3 AND v_o > 0) OR v_e = v_o) THEN
            RAISE EXCEPTION 'wrong expected version for stream %: expected %, found %',
                p_stream_ids[i],
                CASE v_e WHEN -2 THEN 'no stream' WHEN -3 THEN 'an existing stream' ELSE v_e::text END,
                v_o
                USING ERRCODE = 'KL001',
                      DETAIL = json_build_object('stream_id', p_stream_ids[i], 'expected', v_e,
                                                 'actual', v_o)::text;
        END IF;
    END LOOP;

    -- 4. Stream versions, parsed payloads and content digests: still outside the global lock.
    SELECT array_agg(x.ver ORDER BY x.ord), array_agg(x.pj ORDER BY x.ord), array_agg(x.mj ORDER BY x.ord),
           array_agg(
               {CONTENT}
               ORDER BY x.ord)
    INTO v_ev_version, v_payloads, v_metadata, v_digests
    FROM (
        SELECT u.ord, u.s, u.t, u.sv, u.p::jsonb AS pj, u.m::jsonb AS mj,
               v_old[u.s] + row_number() OVER (PARTITION BY u.s ORDER BY u.ord) AS ver
        FROM unnest(p_ev_stream, p_ev_types, p_ev_schema, p_ev_payloads, p_ev_metadata)
             WITH ORDINALITY AS u(s, t, sv, p, m, ord)
    ) x;

    -- 5. The global lock, held until commit: positions are assigned in commit order.
    SELECT h.position, h.hash, greatest(clock_timestamp(), h.recorded_at)
    INTO v_pos, v_h, v_at
    FROM head h FOR UPDATE;
    v_micros := (extract(epoch FROM v_at) * 1000000)::bigint;
    FOR i IN 1 .. v_n LOOP
        v_prev[i] := v_h;
        v_h := sha256(v_h || int8send(v_pos + i) || int8send(v_ev_version[i]) || int8send(v_micros)
                      || v_digests[i]);
        v_hashes[i] := v_h;
    END LOOP;

    INSERT INTO events (position, stream_id, stream_type, stream_version, event_type, schema_version,
                        payload, metadata, idempotency_key, recorded_at, prev_hash, hash)
    SELECT v_pos + u.ord, p_stream_ids[u.s], v_types[u.s], u.ver, u.t, u.sv, u.pj, u.mj, p_key, v_at,
           u.pr, u.h
    FROM unnest(p_ev_stream, p_ev_types, p_ev_schema, v_payloads, v_metadata, v_ev_version, v_prev, v_hashes)
         WITH ORDINALITY AS u(s, t, sv, pj, mj, ver, pr, h, ord);

    UPDATE head SET position = v_pos + v_n, hash = v_h, recorded_at = v_at;

    IF p_key IS NOT NULL THEN
        UPDATE idempotency_keys k SET first_position = v_pos + 1, last_position = v_pos + v_n
        WHERE k.key = p_key;
    END IF;

    RETURN QUERY SELECT v_pos + 1, v_pos + v_n, p_stream_ids, v_new, v_at, false;
END
$fn$;
"""


def upgrade() -> None:
    s = _quote(_schema())
    content = _content("p_stream_ids[x.s]", "v_types[x.s]", "x.t", "x.sv", "x.pj::text", "x.mj::text",
                       "p_key")
    _run(DDL.format(S=s))
    _run(APPEND.replace("{S}", s).replace("{CONTENT}", content))


def downgrade() -> None:
    # Destroys the ledger's data: only for throwaway databases.
    _run(f"DROP SCHEMA IF EXISTS {_quote(_schema())} CASCADE")
