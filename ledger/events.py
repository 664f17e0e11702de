"""Event typing: new and recorded events, expected versions, the registry with upcasters.

Events are plain Python classes the application owns (pydantic models, dataclasses or
anything pydantic's `TypeAdapter` understands) registered under a stable type name and a
schema version. Stored events keep the schema version they were written with; reading
runs the registered upcasters (v1 -> v2 -> ... -> current) before validating into the class,
so old shapes never have to be rewritten (the ledger is immutable).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

import orjson
import pydantic
from pydantic_core import PydanticSerializationError

from kappaflow.ledger.errors import (
    EventTooLargeError,
    InvalidAppendError,
    UnknownEventTypeError,
    UpcastError,
)
from kappaflow.ledger.personal import PersonalSpec, personal_spec, seal
from kappaflow.ledger.query import Tagged

T = TypeVar("T")
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

MAX_ID_CHARS = 1000
DEFAULT_MAX_EVENT_BYTES = 1_048_576


class ExpectedVersion(IntEnum):
    """Symbolic expected versions; an int >= 0 means "exactly this version" (0 = no events yet)."""

    ANY = -1
    NO_STREAM = -2
    STREAM_EXISTS = -3


_EXPECTED_NAMES = {
    "any": ExpectedVersion.ANY,
    "no_stream": ExpectedVersion.NO_STREAM,
    "no-stream": ExpectedVersion.NO_STREAM,
    "stream_exists": ExpectedVersion.STREAM_EXISTS,
    "stream-exists": ExpectedVersion.STREAM_EXISTS,
    "exists": ExpectedVersion.STREAM_EXISTS,
}


def parse_expected_version(value: Any, *, field: str = "expected_version") -> int:
    """An ExpectedVersion, an int >= 0, or its string form ("any", "no_stream", "exists", "12")."""
    if isinstance(value, ExpectedVersion):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidAppendError(
                f"expected an integer >= 0 or one of any/no_stream/stream_exists, got {value} "
                "(negative versions do not exist)", field=field)
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _EXPECTED_NAMES:
            return int(_EXPECTED_NAMES[text])
        if text.isdigit():
            return int(text)
    raise InvalidAppendError(
        f"expected an integer >= 0 or one of any/no_stream/stream_exists, got {value!r}", field=field)


def stream_category(stream_id: str) -> str:
    """The default stream type: the part before the first '-' ("account-42" -> "account")."""
    return stream_id.split("-", 1)[0]


def check_identifier(value: Any, *, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidAppendError(f"expected a non-empty string, got {value!r}", field=field)
    if len(value) > MAX_ID_CHARS:
        raise InvalidAppendError(f"expected at most {MAX_ID_CHARS} characters, got {len(value)}", field=field)
    if "\x00" in value:
        raise InvalidAppendError("NUL characters are not allowed", field=field)
    return value


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An untyped event to append: a type name and JSON-serialisable data."""

    type: str
    data: Mapping[str, Any]
    metadata: Mapping[str, Any] | None = None
    schema_version: int = 1
    tags: Sequence[str] = ()  # "name:value" strings; see kappaflow.ledger.query


@dataclass(slots=True)
class RecordedEvent:
    """An event as stored. `event` is the typed, upcast object when the ledger has a registry.

    Not frozen on purpose: a frozen dataclass sets every field through ``object.__setattr__``,
    4x the construction cost, measurable when a read builds 100k of them per second. Treat it as
    read-only.
    """

    position: int
    stream_id: str
    stream_type: str
    stream_version: int
    event_type: str
    schema_version: int
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: dt.datetime
    idempotency_key: str | None
    hash: bytes | None  # None when the read did not ask for hashes (`hashes=True`)
    event: Any = field(default=None, compare=False)
    tags: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (used by the CLI and the log mapping)."""
        return {
            "position": self.position,
            "stream_id": self.stream_id,
            "stream_type": self.stream_type,
            "stream_version": self.stream_version,
            "event_type": self.event_type,
            "schema_version": self.schema_version,
            "data": self.data,
            "metadata": self.metadata,
            "recorded_at": self.recorded_at.isoformat(),
            "idempotency_key": self.idempotency_key,
            "hash": None if self.hash is None else self.hash.hex(),
            **({"tags": list(self.tags)} if self.tags else {}),
        }


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    """An event ready for the database: JSON text for payload and metadata."""

    type: str
    schema_version: int
    payload: str
    metadata: str
    tags: tuple[str, ...] = ()


TagSpec = Mapping[str, str] | Callable[[Any], Iterable[str]]


@dataclass(slots=True)
class _Entry:
    name: str
    cls: type
    version: int
    adapter: pydantic.TypeAdapter[Any]
    tags: Callable[[Any], Iterable[str]] | None = None
    personal: PersonalSpec | None = None
    validate: Callable[[Any], Any] = field(init=False)

    def __post_init__(self) -> None:
        # The core validator itself: TypeAdapter.validate_python is a Python wrapper around it,
        # measurable when a read decodes every event it returns.
        self.validate = self.adapter.validator.validate_python


class EventRegistry:
    """Maps event classes <-> (type name, schema version), with upcasters for old versions.

    ``strict`` (default) makes the ledger reject NewEvent types that are not registered.
    """

    def __init__(self, *, strict: bool = True) -> None:
        self.strict = strict
        self._by_name: dict[str, _Entry] = {}
        self._by_class: dict[type, _Entry] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    # --- registration -------------------------------------------------------
    def register(self, cls: type[T] | None = None, *, name: str | None = None,
                 version: int = 1, tags: TagSpec | None = None, personal: Iterable[str] | None = None,
                 subject: str | None = None) -> Any:
        """Register a class (usable as ``@registry.register`` or ``@registry.register(name=..., version=2)``).

        `tags` tags every event of the class: ``{"student": "student_id"}`` gives ``student:<the
        event's student_id>`` (a field that is None gives no tag), or a function of the event
        returning tag strings (see `kappaflow.ledger.query`). `personal` names top-level fields
        stored encrypted under the key of the data subject named by the field `subject` (see
        `kappaflow.ledger.personal`; ``kappaflow ledger forget`` erases them).
        """

        def add(klass: type[T]) -> type[T]:
            type_name = check_identifier(name or klass.__name__, field="event type name")
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise InvalidAppendError(f"expected an integer >= 1, got {version!r}", field="version")
            if type_name in self._by_name and self._by_name[type_name].cls is not klass:
                raise InvalidAppendError(
                    f"{type_name!r} is already registered for {self._by_name[type_name].cls.__qualname__}",
                    field="event type name")
            entry = _Entry(type_name, klass, version, pydantic.TypeAdapter(klass), _tag_function(klass, tags),
                           personal_spec(klass, personal, subject))
            self._by_name[type_name] = entry
            self._by_class[klass] = entry
            return klass

        return add(cls) if cls is not None else add

    def upcaster(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Register a function turning data of `from_version` into data of `from_version + 1`."""

        def add(fn: Upcaster) -> Upcaster:
            self._upcasters[(event_type, from_version)] = fn
            return fn

        return add

    def __contains__(self, event_type: object) -> bool:
        return event_type in self._by_name

    def type_name(self, cls: type) -> str:
        return self._by_class[cls].name

    def current_version(self, event_type: str) -> int:
        return self._by_name[event_type].version

    # --- encode / decode ----------------------------------------------------
    def personal_of(self, event_type: str) -> PersonalSpec | None:
        entry = self._by_name.get(event_type)
        return None if entry is None else entry.personal

    def tags_of(self, event: Any) -> Iterable[str]:
        """The tags the registration declares for `event` (none for an unregistered class)."""
        entry = self._by_class.get(type(event))
        return () if entry is None or entry.tags is None else entry.tags(event)

    def to_data(self, event: Any, *, field: str) -> tuple[str, int, Any]:
        """(type name, schema version, JSON-ready data) for a registered object."""
        entry = self._by_class.get(type(event))
        if entry is None:
            raise UnknownEventTypeError(
                f"{type(event).__qualname__} is not a registered event class "
                "(register it with EventRegistry.register)",
                field=field, event_type=type(event).__qualname__)
        try:
            if isinstance(event, pydantic.BaseModel):
                data = event.model_dump(mode="json")
            else:
                data = entry.adapter.dump_python(event, mode="json")
        except PydanticSerializationError as exc:
            raise InvalidAppendError(f"cannot serialise {entry.name}: {exc}", field=f"{field}.data") from None
        return entry.name, entry.version, data

    def decode(self, event_type: str, schema_version: int, data: Any, *, position: int | None = None) -> Any:
        """Upcast stored data to the current version and validate it into the registered class."""
        entry = self._by_name.get(event_type)
        if entry is None:
            raise UnknownEventTypeError(
                f"event type {event_type!r} at position {position} is not registered",
                field="event_type", event_type=event_type, position=position)
        if schema_version == entry.version:  # the common case: no upcasting
            try:
                return entry.validate(data)
            except pydantic.ValidationError as exc:
                raise UpcastError(f"stored data does not match {entry.cls.__qualname__} v{entry.version}: {exc}",
                                  event_type=event_type, position=position) from None
        if schema_version > entry.version:
            raise UpcastError(f"stored schema version {schema_version} is newer than the registered "
                              f"version {entry.version} (deploy the newer event class)",
                              event_type=event_type, position=position)
        for v in range(schema_version, entry.version):
            fn = self._upcasters.get((event_type, v))
            if fn is None:
                raise UpcastError(f"no upcaster from schema version {v} to {v + 1}",
                                  event_type=event_type, position=position)
            data = fn(dict(data))
        try:
            return entry.adapter.validate_python(data)
        except pydantic.ValidationError as exc:
            raise UpcastError(f"stored data does not match {entry.cls.__qualname__} v{entry.version}: {exc}",
                              event_type=event_type, position=position) from None


def _tag_function(cls: type, spec: TagSpec | None) -> Callable[[Any], Iterable[str]] | None:
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, Mapping) or not spec:
        raise InvalidAppendError(f"expected a mapping of tag name to field name, or a function, got {spec!r}",
                                 field="tags")
    from kappaflow.ledger.query import check_tag

    pairs = []
    for tag_name, attr in spec.items():
        check_tag(f"{tag_name}:x", field=f"tags[{tag_name!r}]")
        if not isinstance(attr, str) or not attr:
            raise InvalidAppendError(f"expected a field name, got {attr!r}", field=f"tags[{tag_name!r}]")
        pairs.append((tag_name, attr))

    def tags(event: Any) -> list[str]:
        out = []
        for tag_name, attr in pairs:
            value = getattr(event, attr)
            if value is not None:
                out.append(f"{tag_name}:{value}")
        return out

    return tags


_JSON_OPTS = orjson.OPT_SORT_KEYS


def dumps_json(value: Any, *, field: str) -> bytes:
    """Strict JSON text (sorted keys); errors name the path to the first bad value."""
    try:
        out = orjson.dumps(value, option=_JSON_OPTS)
    except TypeError:
        path, what = _locate_unserialisable(value, field)
        raise InvalidAppendError(f"{what} is not JSON-serialisable", field=path) from None
    if b"\\u0000" in out:
        raise InvalidAppendError("NUL characters (\\u0000) cannot be stored in JSON",
                                 field=_locate_nul(value, field) or field)
    return out


def _locate_unserialisable(value: Any, path: str) -> tuple[str, str]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path}[{k!r}]", f"key of type {type(k).__name__}"
            try:
                orjson.dumps(v, option=_JSON_OPTS)
            except TypeError:
                return _locate_unserialisable(v, f"{path}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            try:
                orjson.dumps(v, option=_JSON_OPTS)
            except TypeError:
                return _locate_unserialisable(v, f"{path}[{i}]")
    elif isinstance(value, int) and not isinstance(value, bool):
        return path, f"integer {value} (outside the 64-bit range)"
    return path, f"value of type {type(value).__name__}"


def _locate_nul(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(k, str) and "\x00" in k:
                return f"{path}[{k!r}]"
            found = _locate_nul(v, f"{path}.{k}")
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _locate_nul(v, f"{path}[{i}]")
            if found:
                return found
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _locate_nul(dataclasses.asdict(value), path)
    return None


def encode_event(event: Any, *, field: str, registry: EventRegistry | None,
                 common_metadata: Mapping[str, Any] | None, max_bytes: int,
                 key_for: Callable[[str], bytes] | None = None) -> EncodedEvent:
    """Turn a typed event or a NewEvent into JSON text, checking type, shape, tags and size."""
    meta: Mapping[str, Any] | None = common_metadata
    extra_tags: Sequence[str] = ()
    if type(event) is Tagged:
        extra_tags = event.tags
        if isinstance(extra_tags, str) or not isinstance(extra_tags, Sequence):
            raise InvalidAppendError(f"expected a list of tags, got {type(extra_tags).__name__}",
                                     field=f"{field}.tags")
        event = event.event
    tags: Any = ()
    if isinstance(event, NewEvent):
        type_name = check_identifier(event.type, field=f"{field}.type")
        version = event.schema_version
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise InvalidAppendError(f"expected an integer >= 1, got {version!r}",
                                     field=f"{field}.schema_version")
        if registry is not None and registry.strict and type_name not in registry:
            raise UnknownEventTypeError(f"event type {type_name!r} is not registered",
                                        field=f"{field}.type", event_type=type_name)
        data: Any = event.data
        if not isinstance(data, Mapping):
            raise InvalidAppendError(f"expected a JSON object (mapping), got {type(data).__name__}",
                                     field=f"{field}.data")
        if not isinstance(data, dict):
            data = dict(data)
        if event.metadata is not None:
            if not isinstance(event.metadata, Mapping):
                raise InvalidAppendError(f"expected a mapping, got {type(event.metadata).__name__}",
                                         field=f"{field}.metadata")
            meta = {**(meta or {}), **event.metadata}
        tags = event.tags
    elif registry is not None:
        type_name, version, data = registry.to_data(event, field=field)
        tags = registry.tags_of(event)
    else:
        raise UnknownEventTypeError(
            f"{type(event).__qualname__} is not a NewEvent and the ledger has no EventRegistry",
            field=field, event_type=type(event).__qualname__)
    spec = registry.personal_of(type_name) if registry is not None else None
    if spec is not None:  # encrypted before anything is hashed, stored or logged
        if not isinstance(data, Mapping):
            raise InvalidAppendError("expected a JSON object for an event with personal fields", field=f"{field}.data")
        if key_for is None:
            raise InvalidAppendError(f"{type_name} has personal fields: append through a Ledger (it holds the keys)",
                                     field=field)
        data = seal(data, spec, key_for, field=field)
    payload = dumps_json(data, field=f"{field}.data")
    metadata = dumps_json(dict(meta) if meta else {}, field=f"{field}.metadata")
    size = len(payload) + len(metadata)
    if size > max_bytes:
        raise EventTooLargeError(field=field, size=size, limit=max_bytes)
    if tags or extra_tags:
        from kappaflow.ledger.query import normalize_tags

        if isinstance(tags, str | bytes):
            raise InvalidAppendError(f"expected a list of tags, got a single {type(tags).__name__}",
                                     field=f"{field}.tags")
        return EncodedEvent(type_name, version, payload.decode(), metadata.decode(),
                            normalize_tags([*tags, *extra_tags], field=f"{field}.tags"))
    return EncodedEvent(type_name, version, payload.decode(), metadata.decode())
