"""One dead-letter naming scheme for every component.

Whatever a component cannot process goes to the topic ``kf.dead_letter.<kind>.<name>`` with the
reason and its position: ``kf.dead_letter.source.<source>`` for a capture source (today the
Debezium source: records it cannot decode), ``kf.dead_letter.projection.<projection>`` for a
projection (events its fold refused, rows a store refused). One prefix, one spelling, and the
component's kind in the name, so a source and a projection of the same name never share a topic
and ``kappaflow log topics`` lists every dead-letter topic together.

Earlier versions used three spellings: ``kf.deadletter.<projection>``, ``<source>.__dead_letter``
and, for the embedded log, the sibling log ``<log dir>.deadletters`` that projections append to
(the embedded log has one writer: the capture). The sibling log keeps its name (it is a place,
not a topic); the old topic names are still read (:func:`legacy_dead_letter_topics`) so dead
letters written before the rename keep counting in ``status`` and ``metrics``.
"""

from __future__ import annotations

from typing import Literal

Component = Literal["source", "projection"]

PREFIX = "kf.dead_letter."


def dead_letter_topic(kind: Component, name: str) -> str:
    """The dead-letter topic of component `name` of `kind` (``source`` or ``projection``)."""
    if kind not in ("source", "projection"):
        raise ValueError(f"dead letters: component kind {kind!r}: expected 'source' or 'projection'")
    return f"{PREFIX}{kind}.{name}"


def legacy_dead_letter_topics(kind: Component, name: str) -> tuple[str, ...]:
    """Where earlier versions wrote the same dead letters (read, never written)."""
    if kind == "projection":
        return (f"kf.deadletter.{name}",)
    return (f"{name}.__dead_letter",)


__all__ = ["PREFIX", "Component", "dead_letter_topic", "legacy_dead_letter_topics"]
