"""Bulk writes: a batch as NDJSON bulk requests with external versions (bounded by documents and
bytes, optionally several in flight), per-item retries with backoff, refused documents returned
as rejects, then the positions."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa

from kappaflow.errors import Retry, SinkError
from kappaflow.projections.sinks.base import (
    VERSION,
    Positions,
    Target,
    WriteResult,
)
from kappaflow.projections.sinks.changes import Change, check_batch, iter_changes
from kappaflow.projections.sinks.codec import encode_json
from kappaflow.projections.sinks.document import Backoff
from kappaflow.projections.sinks.errors import SinkStateLostError
from kappaflow.projections.sinks.keys import MAX_VERSION
from kappaflow.projections.sinks.search.aliases import AliasLifecycle
from kappaflow.projections.sinks.search.client import _error_parts, _HttpError
from kappaflow.projections.sinks.search.options import SearchSinkOptions

MAX_ID_BYTES = 512  # Elasticsearch/OpenSearch hard limit on _id


@dataclass
class _Bulk:
    """One bulk request: NDJSON lines and, per line, the change it carries."""

    lines: list[bytes] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    size: int = 0


def _merge(into: WriteResult, part: WriteResult) -> None:
    into.upserted += part.upserted
    into.deleted += part.deleted
    into.skipped += part.skipped
    into.rejected.extend(part.rejected)


class BulkWriter(AliasLifecycle):
    """Writes and loads through the bulk API (see the module docstring)."""

    def write(self, target: Target, batch: pa.Table, positions: Positions | None = None) -> WriteResult:
        """Upsert/delete with external versions, then store `positions` (never moving one back).

        409s are counted as ``skipped``; documents the server refuses are returned in
        ``rejected`` with the reason and version (the rest proceeds); 429/5xx/connection
        errors are retried with backoff. Raises :class:`SinkStateLostError` when the target
        vanished and a transient :class:`SinkError` when retries run out.
        """
        view = target.view
        check_batch(view, batch, "search sink")
        opts = self.view_options(view)
        index = self.physical_index(target)
        if index is None:
            raise SinkStateLostError(f"search sink: view {view.name!r} has no live index (lost, or ensure() was "
                                     f"never called); re-read positions and replay")
        # Always the build's private write alias, never the public name: bulk deletes cannot carry
        # require_alias, and a delete into a missing index auto-creates it on the server.
        dest = self._write_alias(index)
        result = WriteResult()
        bulks = self._encode(iter_changes(view, batch), dest, opts, result)
        if opts.concurrency > 1:
            self._send_parallel(bulks, target, opts, result)
        else:
            for bulk in bulks:
                self._send(bulk, target, opts, result)
        if opts.refresh_per_batch and not target.shadow and (result.upserted or result.deleted):
            self._call("refresh", lambda: self.client.refresh(dest))  # the batch becomes searchable at once
        if positions:
            self.store_positions(target, positions)
        return result

    def _encode(self, changes: Iterator[Change], dest: str, opts: SearchSinkOptions,
                result: WriteResult) -> Iterator[_Bulk]:
        """NDJSON lines grouped into bulk requests by count and bytes, produced lazily."""
        head = b'{"index":{"_index":' + orjson.dumps(dest) + b',"_id":'
        dhead = b'{"delete":{"_index":' + orjson.dumps(dest) + b',"_id":'
        tail = b',"version_type":"external"}}\n'
        max_docs, max_bytes = opts.bulk_docs, opts.bulk_bytes
        bulk = _Bulk()
        for ch in changes:
            key, ks, row, version = ch
            if ks is None:
                result.rejected.append((key, f"key: NULL in a key column (version {version})"))
                continue
            if type(version) is not int or not 0 <= version <= MAX_VERSION:
                result.rejected.append((key, f"{VERSION}: expected an integer in 0..2^63-1, got {version!r}"))
                continue
            id_json = orjson.dumps(ks)
            if len(id_json) - 2 > MAX_ID_BYTES and len(ks.encode()) > MAX_ID_BYTES:
                result.rejected.append((key, f"key: the document id is {len(ks.encode())} bytes, the server allows "
                                             f"at most {MAX_ID_BYTES} (version {version})"))
                continue
            if row is None:
                line = b'%s%s,"version":%d%s' % (dhead, id_json, version, tail)
            else:
                try:
                    src = encode_json(row)
                except (TypeError, orjson.JSONEncodeError) as exc:
                    result.rejected.append((key, f"row: cannot encode as JSON: {exc} (version {version})"))
                    continue
                if len(src) > max_bytes:
                    result.rejected.append((key, f"row: the document is {len(src)} bytes, more than bulk_bytes="
                                                 f"{max_bytes} (version {version})"))
                    continue
                line = b'%s%s,"version":%d%s%s\n' % (head, id_json, version, tail, src)
            if bulk.lines and (len(bulk.lines) >= max_docs or bulk.size + len(line) > max_bytes):
                yield bulk
                bulk = _Bulk()
            bulk.lines.append(line)
            bulk.changes.append(ch)
            bulk.size += len(line)
        if bulk.lines:
            yield bulk

    def _send_parallel(self, bulks: Iterator[_Bulk], target: Target, opts: SearchSinkOptions,
                       result: WriteResult) -> None:
        with ThreadPoolExecutor(opts.concurrency) as pool:
            inflight: list[Future[WriteResult]] = []
            for bulk in bulks:
                if len(inflight) >= opts.concurrency:
                    _merge(result, inflight.pop(0).result())
                inflight.append(pool.submit(self._send_one, bulk, target, opts))
            for fut in inflight:
                _merge(result, fut.result())

    def _send_one(self, bulk: _Bulk, target: Target, opts: SearchSinkOptions) -> WriteResult:
        out = WriteResult()
        self._send(bulk, target, opts, out)
        return out

    def _send(self, bulk: _Bulk, target: Target, opts: SearchSinkOptions, result: WriteResult) -> None:
        """One bulk request; retries what the server was too busy for, classifies every item."""
        lines, changes = bulk.lines, bulk.changes
        backoff = Backoff(self, opts)
        while lines:
            self._check_fence(target.view, f"writing into {target.name!r}")
            body = b"".join(lines)
            try:
                resp = self._retrying("bulk request", functools.partial(self.client.bulk, body), opts)
            except _HttpError as exc:
                if exc.status == 413 and len(lines) > 1:  # request too large: halve it
                    half = len(lines) // 2
                    self._send(_Bulk(lines[:half], changes[:half]), target, opts, result)
                    lines, changes = lines[half:], changes[half:]
                    continue
                raise SinkError(f"search sink: bulk request into {target.name!r} refused: {exc} (first change: "
                                f"key {changes[0][0]}, version {changes[0][3]})") from None
            items = resp.get("items") or []
            if len(items) != len(lines):
                raise SinkError(f"search sink: the bulk reply has {len(items)} items for {len(lines)} actions",
                                retry=Retry.TRANSIENT)
            retry_lines: list[bytes] = []
            retry_changes: list[Change] = []
            lost = False
            for line, ch, item in zip(lines, changes, items, strict=True):
                op_type, op = next(iter(item.items()))
                status = int(op.get("status", 0))
                if status < 300 or (status == 404 and op_type == "delete" and "error" not in op):
                    if op_type == "delete":
                        result.deleted += 1
                    else:
                        result.upserted += 1
                elif status == 409:
                    result.skipped += 1
                elif status in (429, 500, 502, 503, 504):
                    retry_lines.append(line)
                    retry_changes.append(ch)
                else:
                    kind, reason = _error_parts(op, f"HTTP {status}")
                    if status == 404 and kind == "index_not_found_exception":
                        lost = True
                        continue
                    err = op.get("error")
                    cause = err.get("caused_by") if isinstance(err, Mapping) else None
                    if isinstance(cause, Mapping) and cause.get("reason"):
                        reason = f"{reason} (caused by {cause.get('type')}: {cause.get('reason')})"
                    result.rejected.append((ch[0], f"HTTP {status} {kind}: {reason} (version {ch[3]})"))
            if lost:
                self._positions_ready = False
                raise SinkStateLostError(
                    f"search sink: {target.name!r} is gone from the server (its index or alias is missing: the "
                    f"server lost its data?); re-read positions and replay")
            lines, changes = retry_lines, retry_changes
            if lines:
                busy = changes[0]
                backoff.wait("bulk items", None, warn=False,
                             exhausted=functools.partial(_still_busy, len(lines), busy))


def _still_busy(count: int, first: Any, attempts: int) -> str:
    """The message when documents stay refused as busy after every retry."""
    return (f"search sink: {count} documents still refused as busy after {attempts} attempts (first: key "
            f"{first[0]}, version {first[3]})")
