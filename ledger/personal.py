"""Erasure of personal data without rewriting history (crypto-shredding).

The ledger is immutable and hash-chained, and the log keeps every event; yet a data subject may
ask to be forgotten. So personal fields are never stored in the clear:

    registry.register(CustomerRegistered, personal=("name", "email"), subject="customer_id")

encrypts ``name`` and ``email`` of every such event, client side, with AES-256-GCM
(`cryptography`'s AEAD; the nonce is synthetic, an HMAC of the value, so sealing is
deterministic and a retried append is byte-identical) under a key of its own for each subject
(the event's ``customer_id``),
before the event is hashed, stored, captured or relayed. What is stored in place of a value is
an envelope ``{"kf.enc": base64(nonce || ciphertext), "kf.subject": subject}``; the associated
data binds it to its subject and field, so it cannot be moved to another subject or field.

Reads (`Ledger.read_*`, `load`, `load_events`, the CLI) decrypt with the subject's key.
``kappaflow ledger forget SUBJECT`` (`Ledger.forget`) destroys the key; from then on every
envelope of that subject, wherever a copy went -- the events table, WAL, the log, a replayed
view, a backup of the events -- reads as the marker `FORGOTTEN`, and new personal data for the
subject is refused (`SubjectForgottenError`). The hash chain is over the stored ciphertext, so
`verify` passes before and after. Snapshots may hold decrypted state: a forget deletes them all
(a cache; loads rebuild them). The ledger source writes the stored envelopes to the log, and
the marker itself for subjects already forgotten; projections decrypt through the source's key
table as they read (`reveal_log_values`).

Not guaranteed (see the README): plaintext copied out before the forget (a view not yet
replayed, an export, a client's memory) is not erased; a backup of the key table taken before
the forget still decrypts; the subject id itself (a field of the event, used as the key's
name) is not encrypted -- use a pseudonymous id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
from psycopg import sql

from kappaflow.ledger.errors import InvalidAppendError, LedgerError

FORGOTTEN = "<forgotten>"
ENC = "kf.enc"
SUBJECT = "kf.subject"
_ENC_TEXT = '"kf.enc"'
_ENC_BYTES = b'"kf.enc"'
_NONCE = 12


class SubjectForgottenError(InvalidAppendError):
    """Personal data for a subject that was forgotten: it would be stored with no key to read it."""

    def __init__(self, subject: str, *, field: str) -> None:
        super().__init__(f"subject {subject!r} was forgotten (`kappaflow ledger forget`); personal data for it "
                         "is no longer accepted", field=field)
        self.subject = subject


class KeyUnavailableError(LedgerError):
    """An envelope could not be decrypted although its subject's key exists (damaged ciphertext)."""


@dataclass(frozen=True, slots=True)
class PersonalSpec:
    """Which top-level fields of an event type are personal, and which field names their subject."""

    fields: tuple[str, ...]
    subject: str


def personal_spec(cls: type, personal: Iterable[str] | None, subject: str | None) -> PersonalSpec | None:
    """Validate a registration: personal fields need a subject field, and must accept the marker."""
    if personal is None:
        if subject is not None:
            raise InvalidAppendError("a subject without personal fields has no effect; name the personal fields",
                                     field="personal")
        return None
    if isinstance(personal, str):
        personal = [personal]
    fields = tuple(dict.fromkeys(personal))
    if not fields or not all(isinstance(f, str) and f for f in fields):
        raise InvalidAppendError(f"expected field names, got {personal!r}", field="personal")
    if not subject or not isinstance(subject, str):
        raise InvalidAppendError(
            f"{cls.__qualname__} declares personal fields {list(fields)} but no subject: name the field that "
            "identifies whose data they are (register(..., subject='customer_id'))", field="subject")
    if subject in fields:
        raise InvalidAppendError(f"the subject field {subject!r} cannot be personal itself (it names the key)",
                                 field="personal")
    annotations = _field_annotations(cls)
    for f in (*fields, subject):
        if annotations is not None and f not in annotations:
            raise InvalidAppendError(f"{cls.__qualname__} has no field {f!r}", field="personal" if f != subject
                                     else "subject")
    if annotations is not None:
        import pydantic

        for f in fields:
            try:
                pydantic.TypeAdapter(annotations[f]).validate_python(FORGOTTEN)
            except pydantic.ValidationError:
                raise InvalidAppendError(
                    f"personal field {f!r} of {cls.__qualname__} must accept the forgotten marker {FORGOTTEN!r} "
                    f"(what reads return once its subject is forgotten): annotate it as a str, or e.g. "
                    f"`date | str`", field=f"personal.{f}") from None
    return PersonalSpec(fields, subject)


def _field_annotations(cls: type) -> dict[str, Any] | None:
    """Field -> annotation (with pydantic constraints) for models and dataclasses; None if unknown."""
    model_fields = getattr(cls, "model_fields", None)
    if isinstance(model_fields, dict):
        return {name: f.rebuild_annotation() for name, f in model_fields.items()}
    import dataclasses

    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls, include_extras=True)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}
    return None


def _aad(subject: str, field: str) -> bytes:
    return b"kf.personal.v1\x00" + orjson.dumps([subject, field])


def _aead(key: bytes) -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def seal(data: Mapping[str, Any], spec: PersonalSpec, key_for: Callable[[str], bytes], *, field: str) -> dict[str, Any]:
    """`data` with each present, non-null personal field replaced by its envelope."""
    raw = data.get(spec.subject)
    if raw is None or raw == "" or isinstance(raw, dict | list):
        raise InvalidAppendError(f"expected the subject of the personal fields {list(spec.fields)} (a non-empty "
                                 f"id), got {raw!r}", field=f"{field}.data.{spec.subject}")
    subject = str(raw)
    out = dict(data)
    aead = None
    key = b""
    for f in spec.fields:
        value = out.get(f)
        if value is None:
            continue
        if aead is None:
            key = key_for(subject)
            aead = _aead(key)
        plain, aad = orjson.dumps(value), _aad(subject, f)
        # Synthetic nonce (SIV-style): derived from the key, field and value, so a retry of the
        # same append seals to the same bytes (its idempotency key's request hash matches); the
        # price is that equal values of one subject's field have equal envelopes.
        nonce = hmac.new(key, aad + plain, hashlib.sha256).digest()[:_NONCE]
        ct = aead.encrypt(nonce, plain, aad)
        out[f] = {ENC: base64.b64encode(nonce + ct).decode(), SUBJECT: subject}
    return out


def has_envelopes(text: str | bytes) -> bool:
    """A cheap pre-check on stored JSON text (most events carry no personal data)."""
    return (_ENC_TEXT in text) if isinstance(text, str) else (_ENC_BYTES in text)


def _is_envelope(v: Any) -> bool:
    return type(v) is dict and ENC in v and SUBJECT in v


def subjects_of(data: Mapping[str, Any]) -> set[str]:
    return {v[SUBJECT] for v in data.values() if _is_envelope(v)}


def reveal(data: Mapping[str, Any], keys: Mapping[str, bytes | None]) -> dict[str, Any]:
    """`data` with envelopes decrypted; the marker where the subject's key is gone (or unknown)."""
    out = dict(data)
    for f, v in data.items():
        if not _is_envelope(v):
            continue
        key = keys.get(v[SUBJECT])
        if key is None:
            out[f] = FORGOTTEN
            continue
        blob = base64.b64decode(v[ENC])
        try:
            out[f] = orjson.loads(_aead(key).decrypt(blob[:_NONCE], blob[_NONCE:], _aad(v[SUBJECT], f)))
        except Exception as exc:  # cryptography's InvalidTag: altered ciphertext, or moved to another field
            raise KeyUnavailableError(f"personal field {f!r} of subject {v[SUBJECT]!r} does not decrypt "
                                      f"({type(exc).__name__}): the stored envelope was altered") from None
    return out


def redact(data: Mapping[str, Any], forgotten: set[str]) -> dict[str, Any]:
    """`data` with the envelopes of forgotten subjects replaced by the marker (others kept sealed)."""
    return {f: FORGOTTEN if _is_envelope(v) and v[SUBJECT] in forgotten else v for f, v in data.items()}


@dataclass(frozen=True, slots=True)
class ForgetResult:
    subject: str
    already: bool  # it had been forgotten before: nothing changed
    snapshots_dropped: int

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "forgotten": True, "already": self.already,
                "snapshots_dropped": self.snapshots_dropped}


class KeyStore:
    """The subject keys of one ledger schema, through a connection factory (a pool or a DSN)."""

    def __init__(self, connection: Callable[[], Any], schema: str) -> None:
        self._connection = connection
        t = sql.Identifier(schema, "subject_keys")
        self._write_sql = sql.SQL(
            "with ins as (insert into {t} (subject, key) values (%(s)s, %(k)s) on conflict (subject) do nothing "
            "returning key) select key from ins union all select key from {t} "
            "where subject = %(s)s and not exists (select 1 from ins)").format(t=t)
        self._read_sql = sql.SQL("select subject, key from {t} where subject = any(%s)").format(t=t)
        self._forget_sql = sql.SQL(
            "insert into {t} as k (subject, key, forgotten_at) values (%s, null, now()) on conflict (subject) "
            "do update set key = null, forgotten_at = coalesce(k.forgotten_at, now())").format(t=t)
        self._old_sql = sql.SQL("select forgotten_at is not null from {t} where subject = %s for update").format(t=t)
        self._snapshots_sql = sql.SQL("delete from {}").format(sql.Identifier(schema, "snapshots"))

    def key_for_write(self, subject: str, *, field: str = "events") -> bytes:
        """The subject's key, created on first use; SubjectForgottenError once forgotten."""
        with self._connection() as conn:
            row = conn.execute(self._write_sql, {"s": subject, "k": os.urandom(32)}).fetchone()
        if row is None or row[0] is None:
            raise SubjectForgottenError(subject, field=field)
        return bytes(row[0])

    def keys_for_read(self, subjects: Iterable[str]) -> dict[str, bytes | None]:
        """Keys of `subjects` now (None: forgotten or never had one). Never cached: a forget must
        take effect on the next read."""
        wanted = sorted(set(subjects))
        if not wanted:
            return {}
        with self._connection() as conn:
            rows = conn.execute(self._read_sql, (wanted,)).fetchall()
        found: dict[str, bytes | None] = {s: None for s in wanted}
        found.update({r[0]: None if r[1] is None else bytes(r[1]) for r in rows})
        return found

    def forgotten(self, subjects: Iterable[str]) -> set[str]:
        return {s for s, k in self.keys_for_read(subjects).items() if k is None}

    def forget(self, subject: str) -> ForgetResult:
        """Destroy the subject's key (idempotent) and drop every snapshot (they may hold its
        decrypted data), in one transaction."""
        if not isinstance(subject, str) or not subject or "\x00" in subject:
            raise InvalidAppendError(f"expected a non-empty subject id, got {subject!r}", field="subject")
        with self._connection() as conn, conn.transaction():
            row = conn.execute(self._old_sql, (subject,)).fetchone()
            already = bool(row and row[0])
            conn.execute(self._forget_sql, (subject,))
            dropped = 0 if already else conn.execute(self._snapshots_sql).rowcount
        return ForgetResult(subject, already, max(dropped, 0))

    @classmethod
    def connect(cls, dsn: str, schema: str) -> KeyStore:
        """A key store over its own short connections (for a log reader or a capture)."""
        from contextlib import contextmanager

        @contextmanager
        def connection() -> Any:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
                yield conn

        return cls(connection, schema)


class ForgottenSubjects:
    """Which subjects are forgotten, for writers of the log (the ledger source, the relay): a
    forgotten subject stays forgotten, so that answer is kept; "not forgotten" is re-checked after
    `ttl` seconds (an envelope written meanwhile is unreadable anyway: its key is gone)."""

    def __init__(self, keys: KeyStore, *, ttl: float = 1.0) -> None:
        self.keys = keys
        self.ttl = ttl
        self._forgotten: set[str] = set()
        self._alive: dict[str, float] = {}

    def of(self, subjects: Iterable[str]) -> set[str]:
        import time

        now = time.monotonic()
        wanted = {s for s in subjects if s not in self._forgotten and self._alive.get(s, -1.0) < now}
        if wanted:
            gone = self.keys.forgotten(wanted)
            self._forgotten |= gone
            for s in wanted - gone:
                self._alive[s] = now + self.ttl
            if len(self._alive) > 100_000:
                self._alive.clear()
        return {s for s in subjects if s in self._forgotten}

    def redact_value(self, value: bytes) -> bytes:
        """A log record value with the envelopes of forgotten subjects replaced by the marker."""
        if not has_envelopes(value):
            return value
        doc = orjson.loads(value)
        data = doc.get("data")
        if not isinstance(data, dict):
            return value
        gone = self.of(subjects_of(data))
        if not gone:
            return value
        doc["data"] = redact(data, gone)
        return orjson.dumps(doc)


def reveal_log_values(values: list[bytes | None], keys: KeyStore) -> list[bytes | None]:
    """Ledger log record values (the event JSON, ``data`` sealed as stored) with personal fields
    decrypted -- or the marker for forgotten subjects; one key lookup for the whole batch. Values
    without envelopes are returned as they are (same bytes)."""
    docs: dict[int, dict[str, Any]] = {}
    subjects: set[str] = set()
    for i, v in enumerate(values):
        if v is not None and has_envelopes(v):
            doc = orjson.loads(v)
            if isinstance(doc.get("data"), dict):
                docs[i] = doc
                subjects |= subjects_of(doc["data"])
    if not docs:
        return values
    found = keys.keys_for_read(subjects)
    out = list(values)
    for i, doc in docs.items():
        doc["data"] = reveal(doc["data"], found)
        out[i] = orjson.dumps(doc)
    return out


__all__ = ["FORGOTTEN", "ForgetResult", "ForgottenSubjects", "KeyStore", "KeyUnavailableError", "PersonalSpec",
           "SubjectForgottenError", "has_envelopes", "personal_spec", "redact", "reveal", "reveal_log_values", "seal",
           "subjects_of"]
