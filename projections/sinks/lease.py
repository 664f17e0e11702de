"""Leases: one replay/follow per projection, without a session-bound lock in the store (search
servers and Redis; PostgreSQL uses an advisory lock). The token of a lease fences the holder's writes."""

from __future__ import annotations

from collections.abc import Callable


def lease_margin(ttl_s: float) -> float:
    """How long before a lease's expiry its holder stops trusting it: covers clock skew between
    the holder and a process that compares the lease's wall-clock expiry with its own clock."""
    return min(ttl_s * 0.1, 2.0)


class Lease:
    """A lock held by renewing it: ``acquire`` once, a daemon thread calls ``renew`` every
    ``ttl_s / 3``; a holder killed with -9 stops renewing and the lock expires after ``ttl_s``.

    ``held`` is computed when asked, not by the renewal thread: the lease is held until
    ``ttl_s`` (less ``lease_margin``) after the last renewal that SUCCEEDED was sent, so a
    holder whose renewals keep failing (a partition longer than the lease, a renewal call
    that hangs) stops claiming the lock before anyone else can take it. Once lost, a lease
    stays lost: the holder takes the lock again (a new generation) or gives up.

    ``token`` (``"<generation>:<random>"``) is what the store holds while this lease owns the
    lock; the sinks fence writes with it (``Sink.fence``), so a writer whose lease was lost or
    taken over cannot write. Stores without session-bound locks (Redis, search servers)
    implement the three callables; PostgreSQL uses an advisory lock instead.
    """

    def __init__(self, name: str, ttl_s: float, renew: Callable[[], bool], release: Callable[[], None], *,
                 token: str = "", taken_at: float | None = None) -> None:
        import threading
        import time

        self.name = name
        self.ttl_s = ttl_s
        self.token = token
        self._renew = renew
        self._release = release
        self._stop = threading.Event()
        self.lost = False
        # `taken_at`: monotonic time the take request was SENT (the store's expiry counts from later)
        self.valid_until = (taken_at if taken_at is not None else time.monotonic()) + ttl_s - lease_margin(ttl_s)
        self._thread = threading.Thread(target=self._run, name=f"kappaflow-lease-{name}", daemon=True)
        self._thread.start()

    @property
    def generation(self) -> int:
        return fence_generation(self.token)

    @property
    def held(self) -> bool:
        """Still ours: not lost, and the last successful renewal has not run out."""
        import time

        return not self.lost and time.monotonic() < self.valid_until

    def _run(self) -> None:
        import logging
        import time

        logger = logging.getLogger(__name__)
        while not self._stop.wait(self.ttl_s / 3):
            sent = time.monotonic()
            try:
                ok = self._renew()
            except Exception as exc:  # a store hiccup: try again next round while the lease has time
                if time.monotonic() >= self.valid_until:
                    self.lost = True
                    logger.error("lease %s expired: renewals kept failing for more than %.0f s (last: %s); "
                                 "this holder no longer has the lock and its writes are refused", self.name,
                                 self.ttl_s, exc)
                    return
                logger.warning("renewing lease %s failed: %s", self.name, exc)
                continue
            if not ok or self._stop.is_set():
                if not ok:
                    self.lost = True
                    logger.error("lease %s was lost (expired and taken?)", self.name)
                return
            if time.monotonic() >= self.valid_until:
                # renewed only after it had run out here: writes were refused meanwhile, and a
                # lease that ran out stays lost (the holder takes the lock again or gives up)
                self.lost = True
                logger.error("lease %s ran out before its renewal returned; giving it up", self.name)
                return
            self.valid_until = sent + self.ttl_s - lease_margin(self.ttl_s)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.lost:
            self._release()


def fence_generation(token: str | None) -> int:
    """The lease generation in a fencing token (``"<generation>:<random>"``); 0 when it has none."""
    head = (token or "").partition(":")[0]
    return int(head) if head.isdigit() else 0


__all__ = ["Lease", "fence_generation", "lease_margin"]
