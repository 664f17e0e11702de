"""Run a MySQL capture until killed (the subprocess of the kill -9 trials)."""

from __future__ import annotations

import sys


def main() -> None:
    from kappaflow.connectors.mysql.connector import MySQLConnector
    from kappaflow.log.embedded import EmbeddedLog

    log_dir, dsn, table, chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    log = EmbeddedLog(log_dir)
    conn = MySQLConnector(name="src", log=log, dsn=dsn, tables=[table], snapshot_chunk_rows=chunk, partitions=3,
                          flush_interval_s=0.02, batch_records=50)
    print("started", flush=True)
    conn.run()


if __name__ == "__main__":
    main()
