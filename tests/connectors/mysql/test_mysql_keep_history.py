"""`[sources.<name>] keep_history` on a MySQL/MariaDB source (real MariaDB, embedded log): the table's
topic keeps every version through compaction; an uncaptured table and a compacted topic are refused."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kappaflow.errors import ConfigError
from kappaflow.log.base import CleanupPolicy

pytestmark = pytest.mark.integration


def test_keep_history_on_mariadb(mariadb_server: Any, mariadb_db: str, embedded_log: Any, mh: Any) -> None:
    db = mariadb_db
    mariadb_server.execute(
        "CREATE TABLE h (id INT PRIMARY KEY, v VARCHAR(10))",
        "CREATE TABLE o (id INT PRIMARY KEY, v VARCHAR(10))",
        "INSERT INTO h VALUES (1,'v0')",
        "INSERT INTO o VALUES (1,'v0')",
        db=db,
    )
    with pytest.raises(ConfigError, match=rf"sources\.src\.keep_history: \['{db}\.nope'\] not captured"):
        mh.connector(mariadb_server, db, embedded_log, [f"{db}.h", f"{db}.o"], keep_history=["nope"]).run(
            until_caught_up=True
        )
    # a bare name is in the DSN's database, as in `tables`
    conn = mh.connector(mariadb_server, db, embedded_log, [f"{db}.h", f"{db}.o"], keep_history=["h"])
    conn.run(until_caught_up=True)
    mariadb_server.execute(*(f"UPDATE {t} SET v='v{i}' WHERE id=1" for i in range(1, 4) for t in ("h", "o")), db=db)
    conn.run(until_caught_up=True)
    kept, other = f"src.{db}.h", f"src.{db}.o"
    assert embedded_log.topic_config(kept).cleanup_policy is CleanupPolicy.DELETE
    assert embedded_log.topic_config(other).compacted
    stats = embedded_log.compact_all(now_ms=10**13)
    assert kept not in stats and stats[other].removed == 3
    assert [d["after"]["v"] for d in mh.events(embedded_log, kept)] == ["v0", "v1", "v2", "v3"]
    assert [orjson.loads(r.value)["after"]["v"] for r in mh.values(embedded_log, other)] == ["v3"]
    # the other table's topic exists compacted: listing it now is refused, with the fix
    with pytest.raises(ConfigError, match=rf"topic '{other}' \(table {db}\.o\) exists with cleanup\.policy=compact"):
        mh.connector(mariadb_server, db, embedded_log, [f"{db}.h", f"{db}.o"], keep_history=["h", f"{db}.o"]).run(
            until_caught_up=True
        )
