"""Replay while following: a rebuilt view handed over to the follower that keeps the live one current.

Why: the follower holds the projection's lock in a sink for its lifetime; a replay that needed
that lock had to wait for the follower to stop, and the view stood still until it was started
again. Instead, when a follower holds the lock, the replay builds the shadow WITHOUT it and the
follower -- the only writer of the live view -- catches the shadow up and swaps it in between
two of its own batches, so no change is lost or applied twice and the follower never stops.

Steps (the replay side is ``replay.replay``, the follower side ``Follower._take_handover``):

1. the replay takes the projection's *build* lock in the sink (``<name>#build``: two replays
   never build at once) and finds the follow lock held by another process;
2. it builds a shadow (label ``handover``) from the log up to end offsets E, catches it up a
   few rounds like any replay, and stores its positions with it;
3. it offers the shadow in ``kappaflow.handovers`` (state ``ready``, with the definition's
   fingerprint and the view's shape) and waits (bounded);
4. the follower sees the offer between two batches (its supervisor polls every
   ``HANDOVER_POLL_S``; the batch mutex keeps it apart from a running batch) and claims it
   (``ready`` -> ``taking``, one UPDATE: the replay's withdrawal and the claim cannot both win);
5. under its own lock it folds the log from the shadow's positions up to its own (per partition:
   the larger of the two) into the shadow -- PostgreSQL: rows and positions in one transaction --
   then swaps the shadow in (rename in one transaction / alias / pointer switch), records a new
   generation and reports ``swapped``; its next batch reads the new view's positions, so records
   below them are filtered out (nothing twice) and every record above them is still to come
   (nothing lost);
6. the replay sees ``swapped`` and reports it. A follower running another definition (its
   fingerprint or view shape differs from the replay's) refuses the offer (``refused``, with the
   reason). When the follower neither takes nor refuses it in time, the replay withdraws the offer
   and drops the shadow; when the follower claimed it and then died, the replay takes the lock,
   drops the shadow unless it was swapped in, and says so -- the live view stays as it was.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from kappaflow.projections.engine import ProjectionBusy
from kappaflow.projections.sinks.base import Sink, Target, ViewSpec
from kappaflow.projections.sinks.postgres import ensure_migrated

log = logging.getLogger("kappaflow.projections")

TABLE = '"kappaflow"."handovers"'
SHADOW_LABEL = "handover"
HANDOVER_POLL_S = 0.5
"""How often a follower looks for an offered shadow (one indexed SELECT on the views database)."""

DEFINITION_POLICIES = ("fail", "rebuild")
"""Values of ``on_definition_change``: what a follower does at start when the projection's definition
(its fingerprint) differs from the one its live view was built with."""


def build_lock_name(projection: str) -> str:
    """The lock a replay holds while it builds (beside the follow lock, which it may not get)."""
    return f"{projection}#build"


class HandoverFailed(ProjectionBusy):
    """The follower did not take the rebuilt view (refused it, died, or did not answer in time)."""


@dataclass(frozen=True)
class Offer:
    projection: str
    sink: str
    shadow: str
    fingerprint: str
    view: dict[str, Any]
    state: str
    message: str | None
    generation: int | None

    def target(self) -> Target:
        return Target(ViewSpec.from_dict(self.view), self.shadow, shadow=True)


class Handovers:
    """The offers in ``kappaflow.handovers`` (views database), one per projection and sink."""

    _COLS = "projection, sink, shadow, fingerprint, view, state, message, generation"

    def __init__(self, dsn: str) -> None:
        import psycopg

        ensure_migrated(dsn)
        self.conn = psycopg.connect(dsn, autocommit=True)

    def close(self) -> None:
        self.conn.close()

    def _offer(self, r: tuple[Any, ...] | None) -> Offer | None:
        if r is None:
            return None
        view = r[4] if isinstance(r[4], dict) else orjson.loads(r[4])
        return Offer(r[0], r[1], r[2], r[3], view, r[5], r[6], None if r[7] is None else int(r[7]))

    def offer(self, projection: str, sink: str, shadow: Target, fingerprint: str) -> None:
        """Offer `shadow` (built, positions stored) to the follower of `projection` in `sink`."""
        self.conn.execute(
            f"""INSERT INTO {TABLE} AS h (projection, sink, shadow, fingerprint, view, state)
                VALUES (%s, %s, %s, %s, %s::jsonb, 'ready')
                ON CONFLICT (projection, sink) DO UPDATE SET shadow = excluded.shadow,
                    fingerprint = excluded.fingerprint, view = excluded.view, state = 'ready', message = NULL,
                    generation = NULL, offered_at = now(), updated_at = now()""",
            (projection, sink, shadow.name, fingerprint, orjson.dumps(shadow.view.to_dict()).decode()),
        )

    def get(self, projection: str, sink: str) -> Offer | None:
        return self._offer(
            self.conn.execute(
                f"SELECT {self._COLS} FROM {TABLE} WHERE projection = %s AND sink = %s", (projection, sink)
            ).fetchone()
        )

    def ready(self, projection: str, sink: str) -> bool:
        """Whether a shadow is offered (the follower's cheap poll)."""
        return (
            self.conn.execute(
                f"SELECT 1 FROM {TABLE} WHERE projection = %s AND sink = %s AND state = 'ready'", (projection, sink)
            ).fetchone()
            is not None
        )

    def claim(self, projection: str, sink: str) -> Offer | None:
        """``ready`` -> ``taking``; None when there is no offer (or it was withdrawn first)."""
        return self._offer(
            self.conn.execute(
                f"UPDATE {TABLE} SET state = 'taking', updated_at = now() "
                f"WHERE projection = %s AND sink = %s AND state = 'ready' RETURNING {self._COLS}",
                (projection, sink),
            ).fetchone()
        )

    def finish(
        self, projection: str, sink: str, state: str, message: str | None = None, generation: int | None = None
    ) -> None:
        self.conn.execute(
            f"UPDATE {TABLE} SET state = %s, message = %s, generation = %s, updated_at = now() "
            "WHERE projection = %s AND sink = %s",
            (state, message, generation, projection, sink),
        )

    def withdraw(self, projection: str, sink: str) -> bool:
        """Take back an offer nobody claimed; False when the follower claimed it first."""
        return (
            self.conn.execute(
                f"DELETE FROM {TABLE} WHERE projection = %s AND sink = %s AND state = 'ready' RETURNING 1",
                (projection, sink),
            ).fetchone()
            is not None
        )

    def forget(self, projection: str, sink: str) -> None:
        self.conn.execute(f"DELETE FROM {TABLE} WHERE projection = %s AND sink = %s", (projection, sink))


def shadow_swapped(sink: Sink, shadow: Target) -> bool:
    """Whether `shadow` is the live view now (a swap happened), so it must not be dropped."""
    live = sink.live(shadow.view)
    if live is None:
        return False
    b_live, b_shadow = sink.build_of(live), sink.build_of(shadow)
    if b_live is not None or b_shadow is not None:  # stores with builds: the live build is the shadow's
        return b_live is not None and b_live == b_shadow
    # PostgreSQL: the swap renamed the shadow table and moved its positions to the live view
    return not sink.read_positions(shadow)


def await_handover(
    handovers: Handovers, spec_name: str, sink_name: str, sink: Sink, shadow: Target, timeout_s: float
) -> Offer | None:
    """Step 6: wait (at most `timeout_s`) until the follower swapped the shadow in; HandoverFailed
    (live view intact, shadow dropped unless it was swapped in) otherwise. None: the lock's holder
    went away before it claimed the offer (a follower stopped, a dead process's lease ran out) and
    `sink` took the projection's lock: the caller catches the shadow up and swaps it in itself."""
    deadline = time.monotonic() + timeout_s
    offer = handovers.get(spec_name, sink_name)
    while time.monotonic() < deadline:
        offer = handovers.get(spec_name, sink_name)
        if offer is None or offer.state in ("swapped", "refused"):
            break
        if not sink.is_locked(spec_name):  # the follower is gone: nobody will take it
            offer = handovers.get(spec_name, sink_name)  # it may have finished just before it stopped
            break
        time.sleep(0.1)
    if offer is not None and offer.state == "swapped":
        handovers.forget(spec_name, sink_name)
        return offer
    where = f"projection {spec_name!r} in the {sink_name} sink"
    if offer is not None and offer.state == "refused":
        handovers.forget(spec_name, sink_name)
        if not shadow_swapped(sink, shadow):
            _drop(sink, shadow)
        raise HandoverFailed(
            f"{where}: the follower refused the rebuilt view: {offer.message}; the live view "
            "is unchanged and still followed"
        )
    if handovers.withdraw(spec_name, sink_name) or offer is None:
        if sink.try_lock(spec_name):  # nobody follows it any more: the replay finishes as a plain one
            log.info(
                "projection %r in the %s sink: the lock's holder went away before taking the rebuilt view; "
                "the replay swaps it in itself",
                spec_name,
                sink_name,
            )
            return None
        _drop(sink, shadow)
        if not sink.is_locked(spec_name):
            raise HandoverFailed(
                f"{where}: the follower stopped before it took the rebuilt view; the live view is "
                "unchanged and the shadow was dropped: run the replay again"
            )
        raise HandoverFailed(
            f"{where}: the follower holding the projection's lock did not take the rebuilt view within "
            f"{timeout_s:g} s (it is stuck in a long batch, restarting, or not polling); the live view is "
            "unchanged and the shadow was dropped: run the replay again (or raise --handover-timeout)"
        )
    # Claimed ('taking'): the follower is catching the shadow up. Alive (its lock held): it will finish.
    if not sink.try_lock(spec_name):
        raise HandoverFailed(
            f"{where}: the follower claimed the rebuilt view but has not swapped it in within {timeout_s:g} s; "
            "it keeps the shadow and swaps it in when its catch-up ends (see the follower's log)"
        )
    # The follower died mid-handover: its lock is ours now, no one else swaps.
    try:
        swapped = shadow_swapped(sink, shadow)
        handovers.forget(spec_name, sink_name)
        if not swapped:
            _drop(sink, shadow)
    finally:
        sink.unlock(spec_name)
    if swapped:
        raise HandoverFailed(
            f"{where}: the follower swapped the rebuilt view in and then died before reporting "
            "it; the new view is live, start the follower again"
        )
    raise HandoverFailed(
        f"{where}: the follower died while taking the rebuilt view; the live view is unchanged "
        "(the shadow was dropped): start the follower again, then run the replay again"
    )


def _drop(sink: Sink, shadow: Target) -> None:
    try:
        sink.drop(shadow)
    except Exception as exc:  # the next replay's begin_shadow drops a leftover of the same label
        log.warning("dropping the handover shadow %s failed: %s", shadow.name, exc)


__all__ = [
    "DEFINITION_POLICIES",
    "HANDOVER_POLL_S",
    "SHADOW_LABEL",
    "HandoverFailed",
    "Handovers",
    "Offer",
    "await_handover",
    "build_lock_name",
    "shadow_swapped",
]
