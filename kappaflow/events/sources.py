"""Debezium ``source`` blocks, one module per connector, found through a registry.

Every Debezium connector writes the same common fields first (Debezium 2.6+ order:
``version, connector, name, ts_ms, snapshot, db, sequence, ts_us, ts_ns``) and then its own
(PostgreSQL ``schema, table, txId, lsn, xmin``; MySQL ``table, server_id, gtid, file, pos,
row, thread, query``; ...). A :class:`SourceLayout` describes one connector's part: its Connect
fields, how to write it from a ``SourceInfo``, how to read a position from a block Debezium
wrote, and which of its fields travel in ``SourceInfo.extra`` so a record read from Debezium is
written back field for field. kappaflow adds ``kf_pos`` (the exact position) last.

Layouts are looked up by position type (writing) and by ``source.connector`` (reading); a
connector kappaflow has no layout for is read with the generic one (position: the Kafka
coordinates, every field kept as it came). The layouts belong to their connectors
(``connectors/<kind>/source_info.py``, ``connectors/debezium/sources``): each registers its
position kind, its block's encoder and decoder, its Connect fields and its Spark ordering;
they are imported on the first lookup that misses (``kappaflow.events.position.load_source_info``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kappaflow.errors import ValidationError
from kappaflow.events.model import SourceInfo
from kappaflow.events.position import SOURCE_INFO_MODULES, Position, load_source_info

__all__ = [
    "COMMON_FIELDS",
    "SourceLayout",
    "common_connect_fields",
    "connect_field",
    "layout_for_connector",
    "layout_for_kind",
    "layout_for_position",
    "layout_for_source",
    "layouts",
    "position_parsers",
    "register",
    "source_block",
]

SNAPSHOT_ALLOWED = "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"
COMMON_FIELDS = ("version", "connector", "name", "ts_ms", "snapshot", "db", "sequence", "ts_us", "ts_ns")
_EMPTY: Mapping[str, Any] = {}


def connect_field(ctype: str, name: str, optional: bool = False) -> dict[str, Any]:
    return {"type": ctype, "optional": optional, "field": name}


_SNAPSHOT_FIELD = {
    "type": "string",
    "optional": True,
    "name": "io.debezium.data.Enum",
    "version": 1,
    "parameters": {"allowed": SNAPSHOT_ALLOWED},
    "default": "false",
    "field": "snapshot",
}


def common_connect_fields() -> list[dict[str, Any]]:
    """The Connect fields every Debezium 2.6+ source struct starts with."""
    f = connect_field
    return [f("string", "version"), f("string", "connector"), f("string", "name"), f("int64", "ts_ms"),
            dict(_SNAPSHOT_FIELD), f("string", "db"), f("string", "sequence", True), f("int64", "ts_us", True),
            f("int64", "ts_ns", True)]


@dataclass(frozen=True, slots=True)
class SourceLayout:
    """One connector's part of the source block (see the module docstring).

    ``position(block, in_snapshot)``: the position a Debezium-written block names, or None
    when it names none (e.g. an incremental snapshot read whose ``lsn`` is null).
    ``extra_keys``: fields of a Debezium block kept in ``SourceInfo.extra`` (None: every field
    after the common ones, in the order they came). ``build(source)``: the fields after the
    common ones, in Debezium's order. ``kf_pos_fields``: the Connect fields of the position.
    """

    connectors: tuple[str, ...]
    kind: str
    position_type: type[Position]
    schema_name: str
    fields: tuple[dict[str, Any], ...]
    build: Callable[[SourceInfo], dict[str, Any]]
    position: Callable[[Mapping[str, Any], bool], Position | None]
    kf_pos_fields: tuple[dict[str, Any], ...]
    extra_keys: tuple[str, ...] | None = ()
    table_key: str = "table"
    schema_key: str | None = "schema"
    #: Spark ordering (``kappaflow.projections.schemas.pos_order``): the ``kf_pos`` fields it reads
    #: and ``spark_order(pos)``, five columns ordering positions of this kind like ``sort_key``.
    spark_fields: tuple[str, ...] = ()
    spark_order: Callable[[Any], tuple[Any, ...]] | None = None
    #: ``kf_pos`` dict -> position on the decoder's hot path, or None when it needs the full checks
    #: of ``Position.from_dict`` (which say what is wrong).
    parse_position: Callable[[dict[str, Any]], Position | None] | None = None

    def connect_fields(self, source: SourceInfo | None = None) -> list[dict[str, Any]]:
        """The whole source struct's fields (common, the connector's, ``kf_pos``)."""
        fields = [*common_connect_fields(), *[dict(f) for f in self.fields]]
        if self.extra_keys is None and source is not None and source.extra:
            known = {f["field"] for f in fields}
            fields.extend(_typed_field(k, v) for k, v in source.extra.items() if k not in known and k != "sequence")
        pos = _BY_TYPE.get(type(source.position), self) if source is not None else self
        fields.append({"type": "struct", "fields": [dict(f) for f in pos.kf_pos_fields], "optional": True,
                       "name": f"io.kappaflow.position.{pos.kind}", "version": 1, "field": "kf_pos"})
        return fields

    def extra_from(self, block: Mapping[str, Any], source: SourceInfo) -> dict[str, Any] | None:
        """The fields of a block that go to ``SourceInfo.extra``: what ``build`` would not write
        the same from ``source`` alone (so events kappaflow writes carry none)."""
        if self.extra_keys is None:
            out = {k: v for k, v in block.items() if k not in COMMON_FIELDS and k != "kf_pos"}
        else:
            out = {k: block[k] for k in self.extra_keys if k in block}
            if out and type(source.position) is self.position_type:
                base = self.build(source)
                out = {k: v for k, v in out.items() if k not in base or base[k] != v}
        seq = block.get("sequence")
        if seq is not None:
            out["sequence"] = seq
        return out or None


def _typed_field(name: str, value: Any) -> dict[str, Any]:
    t = type(value)
    ctype = "boolean" if t is bool else "int64" if t is int else "double" if t is float else "string"
    return connect_field(ctype, name, True)


_BY_KIND: dict[str, SourceLayout] = {}
_BY_TYPE: dict[type, SourceLayout] = {}
_BY_CONNECTOR: dict[str, SourceLayout] = {}
_GENERIC: list[SourceLayout] = []


def register(layout: SourceLayout, *, generic: bool = False) -> SourceLayout:
    """Make a layout known (each connector module registers its own at import)."""
    _BY_KIND[layout.kind] = layout
    _BY_TYPE[layout.position_type] = layout
    for name in layout.connectors:
        _BY_CONNECTOR[name] = layout
    if generic:
        _GENERIC[:] = [layout]
    return layout


def _loaded_connector(connector: str) -> SourceLayout | None:
    """The layout of ``connector`` once every source info module is loaded (None: none has it)."""
    load_source_info()
    return _BY_CONNECTOR.get(connector)


def layouts() -> list[SourceLayout]:
    """Every registered layout (all source info modules loaded), in the order of ``SOURCE_INFO_MODULES``
    whatever order they were imported in."""
    load_source_info()
    rank = {name: i for i, name in enumerate(SOURCE_INFO_MODULES)}

    def order(layout: SourceLayout) -> int:
        module = layout.build.__module__
        return next((i for name, i in rank.items() if module == name or module.startswith(name + ".")), len(rank))

    return sorted(_BY_KIND.values(), key=order)


def position_parsers() -> dict[str, Callable[[dict[str, Any]], Position | None]]:
    """Position kind -> its hot-path ``kf_pos`` parser, for the kinds that register one."""
    return {layout.kind: layout.parse_position for layout in layouts() if layout.parse_position is not None}


def layout_for_position(position: Position) -> SourceLayout:
    layout = _BY_TYPE.get(type(position))
    if layout is None:
        load_source_info()
        layout = _BY_TYPE.get(type(position))
    if layout is None:
        raise ValidationError(f"source.position: no source block layout for {type(position).__name__} "
                              f"(known: {sorted(t.__name__ for t in _BY_TYPE)})")
    return layout


def layout_for_kind(kind: str) -> SourceLayout:
    layout = _BY_KIND.get(kind)
    if layout is None:
        load_source_info()
        layout = _BY_KIND.get(kind)
    if layout is None:
        raise ValidationError(f"position_kind: expected one of {sorted(_BY_KIND)}, got {kind!r}")
    return layout


def layout_for_source(s: SourceInfo) -> SourceLayout:
    """The layout a source block is written with: its connector's (a record read from Debezium
    keeps its connector's fields whatever position ordering gave it), else its position's."""
    layout = _BY_CONNECTOR.get(s.connector) or _loaded_connector(s.connector)
    return layout if layout is not None else layout_for_position(s.position)


def layout_for_connector(connector: str) -> SourceLayout:
    """The layout for a Debezium ``source.connector`` value (the generic one when unknown)."""
    layout = _BY_CONNECTOR.get(connector) or _loaded_connector(connector)
    return layout if layout is not None else _GENERIC[0]


def source_block(s: SourceInfo, version: str) -> dict[str, Any]:
    """The source block of ``s`` as Debezium 2.6+ writes it, then ``kf_pos``."""
    layout = (_BY_CONNECTOR.get(s.connector) or _BY_TYPE.get(type(s.position)) or _loaded_connector(s.connector)
              or layout_for_position(s.position))
    extra = s.extra or _EMPTY
    ts_ms = s.ts_ms
    d: dict[str, Any] = {
        "version": version,
        "connector": s.connector,
        "name": s.name,
        "ts_ms": ts_ms,
        "snapshot": s.snapshot,
        "db": s.db,
        "sequence": extra.get("sequence"),
        "ts_us": s.ts_us if s.ts_us is not None else ts_ms * 1000,
        "ts_ns": s.ts_ns if s.ts_ns is not None else ts_ms * 1_000_000,
    }
    d.update(layout.build(s))
    d["kf_pos"] = s.position.to_dict()
    return d
