"""Scraping a process's /metrics over HTTP, as Prometheus does (text exposition format)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests._kill import wait_for

URL_LINE = re.compile(r"metrics on (http://127\.0\.0\.1:\d+/metrics)")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(url: str) -> Samples:
    return parse(fetch(url))


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def endpoint_of(log_file: Path, timeout: float = 240) -> str:
    """The URL a process announced ("metrics on http://...") in its log (it was started with port 0)."""

    def found() -> str | None:
        m = URL_LINE.search(log_file.read_text(errors="replace"))
        return m.group(1) if m else None

    return str(wait_for(found, timeout, f"the metrics URL in {log_file}"))
