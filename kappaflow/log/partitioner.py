"""Kafka's default partitioner (murmur2), so both log backends and Java clients agree."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

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


# --- vectorised: a whole append's keys at once (numpy uint32 arithmetic wraps like Java's int) ---
_M32 = np.uint32(0x5BD1E995)
_SEED = 0x9747B28C
_VECTOR_MIN = 64  # below this many keys the cached scalar murmur2 is faster


def _murmur2_rows(buf: np.ndarray, length: int) -> np.ndarray:
    """Kafka's murmur2 over each row of a (m, length) uint8 array, as uint32 (vectorised)."""
    m = buf.shape[0]
    h = np.full(m, (_SEED ^ length) & 0xFFFFFFFF, dtype=np.uint32)
    n4 = length // 4
    if n4:
        words = np.ascontiguousarray(buf[:, : n4 * 4]).view("<u4")
        for i in range(n4):
            k = words[:, i] * _M32
            k ^= k >> np.uint32(24)
            k *= _M32
            h *= _M32
            h ^= k
    rem = length & 3
    tail = n4 * 4
    if rem == 3:
        h ^= buf[:, tail + 2].astype(np.uint32) << np.uint32(16)
    if rem >= 2:
        h ^= buf[:, tail + 1].astype(np.uint32) << np.uint32(8)
    if rem >= 1:
        h ^= buf[:, tail].astype(np.uint32)
        h *= _M32
    h ^= h >> np.uint32(13)
    h *= _M32
    h ^= h >> np.uint32(15)
    return h


def murmur2_many(keys: Sequence[bytes]) -> list[int]:
    """murmur2 of every key, signed like Java's (vectorised by key length)."""
    return _murmur2_u32(keys).view(np.int32).tolist()


def _murmur2_u32(keys: Sequence[bytes]) -> np.ndarray:
    if not keys:
        return np.empty(0, dtype=np.uint32)
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    out = np.empty(len(keys), dtype=np.uint32)
    first = int(lens[0])
    if bool((lens == first).all()):
        groups: list[tuple[int, np.ndarray | None]] = [(first, None)]
    else:
        groups = [(int(ln), np.flatnonzero(lens == ln)) for ln in np.unique(lens)]
    for length, where in groups:
        ks = keys if where is None else [keys[i] for i in where.tolist()]
        if length == 0:
            buf = np.zeros((len(ks), 0), dtype=np.uint8)
        else:
            buf = np.frombuffer(b"".join(ks), dtype=np.uint8).reshape(len(ks), length)
        hashes = _murmur2_rows(buf, length)
        if where is None:
            out = hashes
        else:
            out[where] = hashes
    return out


def partitions_for(keys: Sequence[bytes | None], partitions: int) -> list[int]:
    """`partition_for` of every key, vectorised for large batches."""
    if partitions == 1:
        return [0] * len(keys)
    if len(keys) < _VECTOR_MIN:
        return [partition_for(k, partitions) for k in keys]
    if None in keys:
        present = [k for k in keys if k is not None]
        it = iter(partitions_for(present, partitions)) if present else iter(())
        return [0 if k is None else next(it) for k in keys]
    hashes = _murmur2_u32(keys) & np.uint32(0x7FFFFFFF)  # type: ignore[arg-type]
    return (hashes % np.uint32(partitions)).tolist()
