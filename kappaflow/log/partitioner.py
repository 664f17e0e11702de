"""Kafka's default partitioner (murmur2), so both log backends and Java clients agree."""

from __future__ import annotations

from functools import lru_cache

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's `Utils.murmur2`, returned as a signed 32-bit int like Java's."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    n4 = length & ~3
    for i in range(0, n4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    rem = length & 3
    if rem == 3:
        h ^= data[n4 + 2] << 16
    if rem >= 2:
        h ^= data[n4 + 1] << 8
    if rem >= 1:
        h ^= data[n4]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


@lru_cache(maxsize=262_144)
def _positive_hash(key: bytes) -> int:
    return murmur2(key) & 0x7FFFFFFF


def partition_for(key: bytes | None, partitions: int) -> int:
    """Partition of `key` among `partitions`; keyless records go to partition 0.

    Java's producer spreads keyless records (sticky partitioning); kappaflow never
    writes keyless records to keyed topics, so a fixed choice keeps order.
    """
    if key is None or partitions == 1:
        return 0
    return _positive_hash(key) % partitions
