"""Errors every sink raises beyond the ``SinkError`` of ``kappaflow.errors``: the store lost the view's
data, or a fenced writer lost its lock. The engine and the runners react to these by type."""

from __future__ import annotations

from kappaflow.errors import Retry, SinkError


class SinkStateLostError(SinkError):
    """The store lost data the sink had written (index or namespace gone, server restarted empty).

    Transient, but not "retry the same batch": the positions the runner holds describe
    data that no longer exists. The runner must call ``ensure`` and ``read_positions``
    again (they now report an empty view) and replay the log from there.
    """

    retry = Retry.TRANSIENT


class LockLostError(SinkError):
    """A fenced write was refused: the writer's lease on the projection lock expired or was taken
    over (transient: the writer may take the lock again, or give up if another holder has it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry=Retry.TRANSIENT)


__all__ = ["LockLostError", "SinkStateLostError"]
