"""EmbeddedLog append fast paths: result-less appends, headers encoded once per headers object,
per-record CRCs computed over the joined record bytes."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from kappaflow.errors import ValidationError
from kappaflow.log.base import CleanupPolicy, Record, TopicConfig
from kappaflow.log.embedded.codec import encode


def _topic(log: Any, name: str = "t", partitions: int = 4) -> str:
    log.create_topic(name, TopicConfig(partitions=partitions, cleanup_policy=CleanupPolicy.DELETE))
    return name


def _all(log: Any, topic: str) -> list[tuple[int, int, bytes | None, bytes | None, tuple[Any, ...]]]:
    return sorted((r.partition, r.offset, r.key, r.value, tuple(r.headers))
                  for p in range(log.partitions(topic)) for r in log.iter_partition(topic, p))


def test_append_quiet_writes_what_append_writes(tmp_path: Any) -> None:
    from kappaflow.log.embedded import EmbeddedLog

    shared = (("kf.op", b"c"),)
    recs = [Record(b"k%d" % (i % 7), b"v%d" % i, shared if i % 3 else (("kf.op", b"u"), ("x", b"")))
            for i in range(50)] + [Record(None, b"keyless"), Record(b"k1", None)]
    with EmbeddedLog(tmp_path / "a") as a, EmbeddedLog(tmp_path / "b") as b:
        ta, tb = _topic(a), _topic(b)
        a.append_quiet(ta, recs)
        appended = b.append(tb, recs)
        assert len(appended) == len(recs)
        assert a.end_offsets(ta) == b.end_offsets(tb)
        assert _all(a, ta) == _all(b, tb)
        a.append_quiet(ta, [])
        assert a.end_offsets(ta) == b.end_offsets(tb)


def test_headers_shared_and_distinct_objects(embedded_log: Any) -> None:
    t = _topic(embedded_log, partitions=1)
    h1 = (("a", b"1"),)
    h2: Any = [("a", b"1")]  # equal content, different object and type
    recs = [Record(b"k", b"0", h1), Record(b"k", b"1", h2), Record(b"k", b"2"), Record(b"k", b"3", h1)]
    embedded_log.append_quiet(t, recs)
    got = embedded_log.read(t, 0, 0)
    assert [tuple(r.headers) for r in got] == [(("a", b"1"),), (("a", b"1"),), (), (("a", b"1"),)]


def test_bad_headers_name_the_first_bad_record(embedded_log: Any) -> None:
    from kappaflow.connectors.base import TrustedRecord

    t = _topic(embedded_log, partitions=1)
    good = (("a", b"1"),)
    bad: Any = (("a", "not bytes"),)
    recs = [TrustedRecord(b"k", b"v", good), TrustedRecord(b"k", b"v", bad), TrustedRecord(b"k", b"v", bad)]
    with pytest.raises(ValidationError, match="record 1: header 'a' value: expected bytes"):
        embedded_log.append_quiet(t, recs)
    assert embedded_log.end_offset(t, 0) == 0
    # headers=None from a connector's unchecked record counts as "no headers", as before
    no_headers: Any = None
    embedded_log.append_quiet(t, [TrustedRecord(b"k", b"v", no_headers)])
    assert embedded_log.read(t, 0, 0)[0].headers == ()


def test_record_crcs_are_chained_crc32_of_key_value_headers() -> None:
    keys = [b"a", b"bb", None]
    values = [b"x" * 100, None, b"z"]
    heads = [b"h1", b"", b"h3"]
    for ks, vs, hs in ((keys, values, heads), (keys[:1], values[:1], heads[:1]), (keys[:1], values[:1], None)):
        batch = encode(None, 0, ks, vs, [0] * len(ks), hs)
        crcs = [zlib.crc32(h, zlib.crc32(v or b"", zlib.crc32(k or b"")))
                for k, v, h in zip(ks, vs, hs or [b""] * len(ks), strict=True)]
        assert batch.idx.endswith(b"".join(c.to_bytes(4, "little") for c in crcs))
