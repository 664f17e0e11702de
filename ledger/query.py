"""Tags, queries and append conditions: consistency over a set of events that is not one stream.

A stream's expected version protects a decision that depends on one stream. Some decisions
depend on events of many streams: a username unique across accounts, a course that admits at
most 30 students across enrolments. Dynamic consistency boundaries (the model pyeventsourcing
9.5, Marten, Axon 5 and KurrentDB adopted) put the boundary in the query instead:

    q = Query.where(tags=["course:7"], types=["StudentEnrolled", "CourseCapacityChanged"])
    seen = ledger.read_query(q)                      # the events the decision needs + the position
    if count_enrolled(seen.events) < capacity(seen.events):
        ledger.append("enrolment-42-7", [StudentEnrolled(student_id="42", course_id="7")],
                      condition=seen.condition)      # fail if an event matching q came after it

The append fails with `AppendConditionFailedError` (naming the query item and the position of
the first event that broke it) if any event matching `q` was appended after `seen.position`;
read again and decide again. The check runs in the server under the ledger lock, atomically
with the append.

Semantics (as the DCB specification): a `Query` is a union of `QueryItem`s; an event matches an
item when its type is one of the item's types (any type if none are given) AND it carries every
tag of the item. Tags are ``name:value`` strings (``student:42``), given per event
(`NewEvent.tags`, `Tagged`) or declared per event class (``registry.register(cls,
tags={"student": "student_id"})`` tags each event with ``student:<its student_id>``). They are
stored with the event, covered by the hash chain, indexed (``event_tags``: a condition costs one
index probe per tag), and reach the log as ``kf.ledger.tag`` record headers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from kappaflow.ledger.errors import InvalidAppendError

if TYPE_CHECKING:
    from kappaflow.ledger.events import RecordedEvent

MAX_TAG_CHARS = 500
MAX_TAGS_PER_EVENT = 64
_TAG = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,99}:[^\x00-\x1f]+\Z")
TAG_FORMAT = ("a tag 'name:value' (name: a letter, then letters, digits, '_', '.' or '-', at most 100; "
              "value: at least one character, no control characters)")


def check_tag(tag: Any, *, field: str) -> str:
    """A well-formed tag, or InvalidAppendError naming `field` and the expected format."""
    if not isinstance(tag, str) or len(tag) > MAX_TAG_CHARS or _TAG.match(tag) is None:
        shown = repr(tag) if not isinstance(tag, str) or len(tag) <= 80 else repr(tag[:80] + "...")
        raise InvalidAppendError(f"expected {TAG_FORMAT}, at most {MAX_TAG_CHARS} characters, got {shown}",
                                 field=field)
    return tag


def normalize_tags(tags: Iterable[Any], *, field: str) -> tuple[str, ...]:
    """Checked, de-duplicated and sorted (the order is part of the hashed content)."""
    if isinstance(tags, str | bytes):
        raise InvalidAppendError(f"expected a list of tags, got a single {type(tags).__name__}", field=field)
    out = {check_tag(t, field=f"{field}[{i}]") for i, t in enumerate(tags)}
    if len(out) > MAX_TAGS_PER_EVENT:
        raise InvalidAppendError(f"expected at most {MAX_TAGS_PER_EVENT} tags, got {len(out)}", field=field)
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class Tagged:
    """An event (typed or `NewEvent`) with extra tags for this append."""

    event: Any
    tags: Sequence[str]


@dataclass(frozen=True, slots=True)
class QueryItem:
    """Events of one of `types` (any type when empty) carrying ALL of `tags`."""

    types: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()

    def matches(self, event_type: str, tags: Iterable[str]) -> bool:
        return (not self.types or event_type in self.types) and set(self.tags).issubset(tags)

    def to_json(self) -> dict[str, list[str]]:
        return {"types": list(self.types), "tags": list(self.tags)}

    def __str__(self) -> str:
        parts = []
        if self.types:
            parts.append("types " + "|".join(self.types))
        if self.tags:
            parts.append("tags " + " & ".join(self.tags))
        return "[" + (", ".join(parts) or "any event") + "]"


@dataclass(frozen=True, slots=True)
class Query:
    """A union of `QueryItem`s; combine with ``|``. `Query.all()` matches every event."""

    items: tuple[QueryItem, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.items:
            raise InvalidAppendError("a query needs at least one item (Query.all() matches every event)",
                                     field="query")
        for i, item in enumerate(self.items):
            if not isinstance(item, QueryItem):
                raise InvalidAppendError(f"expected a QueryItem, got {type(item).__name__}", field=f"query.items[{i}]")

    @classmethod
    def where(cls, *, types: Iterable[str] = (), tags: Iterable[str] = ()) -> Query:
        """One item: events of any of `types` (any type if none) that carry every tag in `tags`."""
        if isinstance(types, str):
            types = [types]
        if isinstance(tags, str):
            tags = [tags]
        from kappaflow.ledger.events import check_identifier

        ty = tuple(dict.fromkeys(check_identifier(t, field=f"query.types[{i}]") for i, t in enumerate(types)))
        tg = normalize_tags(tags, field="query.tags")
        if not ty and not tg:
            raise InvalidAppendError("expected at least one type or tag (Query.all() matches every event)",
                                     field="query")
        return cls((QueryItem(ty, tg),))

    @classmethod
    def all(cls) -> Query:
        return cls((QueryItem(),))

    def __or__(self, other: Query) -> Query:
        if not isinstance(other, Query):
            return NotImplemented
        return Query(tuple(dict.fromkeys(self.items + other.items)))

    def matches(self, event_type: str, tags: Iterable[str]) -> bool:
        tags = set(tags)
        return any(item.matches(event_type, tags) for item in self.items)

    def to_json(self) -> bytes:
        return orjson.dumps([item.to_json() for item in self.items])

    def __str__(self) -> str:
        return " | ".join(str(i) for i in self.items)


@dataclass(frozen=True, slots=True)
class AppendCondition:
    """Fail the append if an event matching `query` was appended after position `after`."""

    query: Query
    after: int

    def __post_init__(self) -> None:
        if not isinstance(self.query, Query):
            raise InvalidAppendError(f"expected a Query, got {type(self.query).__name__}", field="condition.query")
        if not isinstance(self.after, int) or isinstance(self.after, bool) or self.after < 0:
            raise InvalidAppendError(f"expected a ledger position >= 0, got {self.after!r}", field="condition.after")


@dataclass(frozen=True, slots=True)
class QueryResult:
    """The events matching `query` up to `position` (the ledger head when they were read)."""

    query: Query
    events: list[RecordedEvent]
    position: int

    @property
    def condition(self) -> AppendCondition:
        """The condition that makes an append fail if anything this read saw has changed."""
        return AppendCondition(self.query, self.position)


def parse_text_array(text: str) -> list[str]:
    """A one-dimensional PostgreSQL ``text[]`` in its text output form (``{a,"b c"}``), as a
    logical-decoding connector receives it. NULL elements are not expected (tags have none)."""
    if len(text) < 2 or text[0] != "{" or text[-1] != "}":
        raise ValueError(f"not a PostgreSQL array literal: {text[:80]!r}")
    out: list[str] = []
    i, n = 1, len(text) - 1
    while i < n:
        if text[i] == '"':
            i += 1
            buf = []
            while text[i] != '"':
                if text[i] == "\\":
                    i += 1
                buf.append(text[i])
                i += 1
            out.append("".join(buf))
            i += 1
        else:
            j = text.find(",", i)
            j = n if j < 0 else j
            out.append(text[i:j])
            i = j
        if i < n and text[i] == ",":
            i += 1
    return out


__all__ = ["AppendCondition", "Query", "QueryItem", "QueryResult", "Tagged", "check_tag", "normalize_tags",
           "parse_text_array"]
