"""The embedded log backend: a directory of SQLite files (see `log` for the layout and guarantees).

`codec` encodes record batches, `control` carries `kappaflow log compact` requests to the running
writer, `space` gives disk space back after compaction; `log` is `EmbeddedLog`. `EmbeddedLog` and
`RecordColumns` stay importable from here, their import path before the backends became packages.
"""

from kappaflow.log.embedded.log import EmbeddedLog, RecordColumns

__all__ = ["EmbeddedLog", "RecordColumns"]
