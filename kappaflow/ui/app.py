"""``kappaflow ui``: a small read-only status page (Starlette + uvicorn, plots by plotly).

What it shows, per load (the page reloads itself every ``[ui] refresh_s`` seconds):

- sources: kind, phase, last durable position, changes, snapshot rows, retained / unconfirmed WAL
  or binlog behind (``kappaflow.metrics.report``: the same figures as ``kappaflow metrics``);
- projections per sink: rows, following, lag in records and seconds, dead letters, last update;
- plots of lag and throughput over the last hour, from the history the processes keep in the views
  database (``kappaflow.metrics.history``).

Read-only by construction (GET routes only, nothing it calls writes), bound to localhost unless
``[ui] host`` says otherwise, and nothing on it comes from a DSN: names, positions and redacted errors.
plotly.js is served from the plotly wheel itself, so the page works without any network.
"""

from __future__ import annotations

import html
import time
from datetime import UTC, datetime
from functools import lru_cache
from itertools import pairwise
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route

from kappaflow.metrics.history import HistoryStore, Point, parse_key
from kappaflow.metrics.report import Report, build_report

__all__ = ["create_app", "render_page"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #b00020; font-weight: 600; }
.ok { color: #1b5e20; }
.muted { color: #777; }
"""


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1000
    return f"{n:,}"


def _e(v: Any) -> str:
    return html.escape("-" if v is None else str(v))


def _sources_table(report: Report) -> str:
    if not report.sources:
        return '<p class="muted">no sources configured</p>'
    rows = []
    for s in report.sources:
        r = s.reading
        behind = "-"
        if r is not None and r.binlog_files_behind is not None:
            behind = f"{r.binlog_files_behind} file(s), {_fmt_bytes(r.binlog_bytes_behind)}"
        rows.append(
            "<tr>"
            f'<td class="source">{_e(s.name)}</td><td>{_e(s.kind)}</td><td>{_e(s.phase)}</td>'
            f"<td>{_e(s.position)}</td>"
            f'<td class="num">{"-" if s.events is None else f"{s.events:,}"}</td>'
            f'<td class="num">{"-" if s.snapshot_rows is None else f"{s.snapshot_rows:,}"}</td>'
            f'<td class="num">{_fmt_bytes(r.retained_wal_bytes if r else None)}</td>'
            f'<td class="num">{_fmt_bytes(r.unconfirmed_wal_bytes if r else None)}</td>'
            f"<td>{_e(behind)}</td>"
            f'<td class="bad">{_e(s.error) if s.error else ""}</td>'
            "</tr>"
        )
    head = ("<tr><th>source</th><th>kind</th><th>phase</th><th>position</th><th>changes</th><th>snapshot rows</th>"
            "<th>retained WAL</th><th>unconfirmed WAL</th><th>binlog behind</th><th>error</th></tr>")
    return f'<table id="sources">{head}{"".join(rows)}</table>'


def _projections_table(report: Report) -> str:
    if not report.projections:
        return '<p class="muted">no projections with a live view (run kappaflow replay)</p>'
    rows = []
    for p in report.projections:
        for s in p.sinks:
            following = '<span class="ok">yes</span>' if s.following else '<span class="bad">no</span>'
            rows.append(
                "<tr>"
                f'<td class="projection">{_e(p.name)}</td><td class="sink">{_e(s.sink)}</td><td>{_e(p.view)}</td>'
                f'<td class="num">{"?" if s.rows is None else f"{s.rows:,}"}</td><td>{following}</td>'
                f'<td class="num">{sum(x.position for x in s.partitions):,}</td>'
                f'<td class="num">{s.lag_records:,}</td><td class="num">{s.lag_seconds:,.1f}</td>'
                f'<td class="num">{p.dead_letters:,}</td><td>{_e(str(p.updated_at or "")[:19])}</td>'
                f'<td class="bad">{_e(s.error) if s.error else ""}</td>'
                "</tr>"
            )
    head = ("<tr><th>projection</th><th>sink</th><th>view</th><th>rows</th><th>following</th><th>position</th>"
            "<th>lag (records)</th><th>lag (s)</th><th>dead letters</th><th>last update</th><th>error</th></tr>")
    return f'<table id="projections">{head}{"".join(rows)}</table>'


def _rate(points: list[Point]) -> tuple[list[datetime], list[float]]:
    """Per-second rate between consecutive samples of a counter (a restart's reset counts from 0)."""
    xs, ys = [], []
    for a, b in pairwise(points):
        dt = (b.ts - a.ts).total_seconds()
        if dt <= 0:
            continue
        delta = b.value - a.value if b.value >= a.value else b.value
        xs.append(b.ts)
        ys.append(delta / dt)
    return xs, ys


def _label(labels: dict[str, str]) -> str:
    if "projection" in labels:
        return f"{labels['projection']}/{labels.get('sink', '')}"
    return labels.get("source", "")


def _plots(history: dict[str, list[Point]] | None) -> tuple[str, str]:
    import plotly.graph_objects as go

    lag = go.Figure()
    rate = go.Figure()
    for key, points in sorted((history or {}).items()):
        name, labels = parse_key(key)
        label = _label(labels)
        if name in ("kappaflow_follow_lag_seconds", "kappaflow_capture_source_lag_seconds"):
            what = "view" if name.startswith("kappaflow_follow") else "source"
            lag.add_trace(go.Scatter(x=[p.ts for p in points], y=[p.value for p in points], mode="lines+markers",
                                     name=f"{what} {label}"))
        elif name in ("kappaflow_follow_events_total", "kappaflow_capture_changes_total",
                      "kappaflow_relay_events_total"):
            xs, ys = _rate(points)
            what = {"kappaflow_follow_events_total": "applied", "kappaflow_capture_changes_total": "captured",
                    "kappaflow_relay_events_total": "relayed"}[name]
            rate.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=f"{what} {label}"))
    lag.update_layout(title="lag over the last hour (seconds)", height=360, margin={"t": 40},
                      yaxis_title="seconds", xaxis_title="time (UTC)")
    rate.update_layout(title="throughput over the last hour (records/s)", height=360, margin={"t": 40},
                       yaxis_title="records/s", xaxis_title="time (UTC)")
    cfg = {"displaylogo": False, "staticPlot": False}
    return (lag.to_html(full_html=False, include_plotlyjs=False, div_id="lag-plot", config=cfg),
            rate.to_html(full_html=False, include_plotlyjs=False, div_id="throughput-plot", config=cfg))


def render_page(settings: Any) -> str:
    report = build_report(settings)
    history = None
    note = ""
    if settings.views.postgres_dsn:
        store = HistoryStore(settings.views.postgres_connect_dsn(), interval_s=settings.metrics.history_interval_s,
                             retention_s=settings.metrics.history_retention_s)
        try:
            history = store.read(3600)
        except Exception:
            note = "the history could not be read from the views database"
        finally:
            store.close()
    else:
        note = "no history: the plots need [views.postgres] dsn, where the processes keep it"
    lag_plot, rate_plot = _plots(history)
    errors = "".join(f'<li class="bad">{_e(e)}</li>' for e in report.errors)
    taken = datetime.fromtimestamp(report.taken_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{int(settings.ui.refresh_s)}">
<title>kappaflow status</title><style>{_STYLE}</style>
<script src="/static/plotly.min.js"></script></head>
<body>
<h1>kappaflow status</h1>
<p class="muted">read at {taken}; reloads every {int(settings.ui.refresh_s)} s. {_e(note) if note else ""}</p>
{f"<ul>{errors}</ul>" if errors else ""}
<h2>Sources</h2>
{_sources_table(report)}
<h2>Projections</h2>
{_projections_table(report)}
<h2>Lag</h2>
{lag_plot}
<h2>Throughput</h2>
{rate_plot}
</body></html>"""


@lru_cache(maxsize=1)
def _plotly_js() -> bytes:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode()


def create_app(settings: Any) -> Starlette:
    async def page(request: Request) -> Response:
        import anyio

        started = time.monotonic()
        body = await anyio.to_thread.run_sync(render_page, settings)
        return HTMLResponse(body, headers={"x-render-seconds": f"{time.monotonic() - started:.3f}"})

    async def plotly_js(request: Request) -> Response:
        return Response(_plotly_js(), media_type="application/javascript",
                        headers={"cache-control": "max-age=86400"})

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[
        Route("/", page, methods=["GET"]),
        Route("/static/plotly.min.js", plotly_js, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ])
