"""Watch a running server's speculative decoding through its Prometheus ``/metrics``.

vLLM's counters are cumulative over the server's life, so every figure here is taken over a
window: the difference of two scrapes, ``--interval`` seconds apart. The figures use the
definitions of :mod:`vllm_peagle.metrics` (AL counts the bonus token; per-position acceptance
is unconditional). Counter and label names are vLLM's own, from
``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingProm``) and ``vllm/v1/metrics/loggers.py``.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

from vllm_peagle.metrics import COUNTER_PREFIX, SpecDecodeCounters

DEFAULT_THRESHOLD = 0.75
"""Draft acceptance rate under which a window alerts (the P-EAGLE deployment KPI)."""

GENERATION_TOKENS = "vllm:generation_tokens"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PER_POSITION = COUNTER_PREFIX + "num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class Reading:
    """One scrape: the cumulative counters plus the queue gauges at that moment."""

    time: float
    """Seconds on a monotonic clock (only differences mean anything)."""
    counters: SpecDecodeCounters
    generation_tokens: int
    requests_running: float
    requests_waiting: float
    spec_decode_enabled: bool
    """Whether the server exposes spec-decode counters at all (it does only with a
    ``--speculative-config``), so "no drafts yet" and "not speculating" read differently."""


def _base_name(sample_name: str) -> str:
    # prometheus_client writes a counter `x` as the sample `x_total`; a scrape through a
    # proxy may lack the TYPE line, so match on the sample name, not on the family.
    return sample_name.removesuffix("_total")


def parse_metrics(text: str, now: float, model_name: str | None = None) -> Reading:
    """A :class:`Reading` from Prometheus text, summed over engines (data parallelism gives
    one label set per engine) and, for the per-position counter, grouped by position."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if model_name is not None and sample.labels.get("model_name") != model_name:
                continue
            name = _base_name(sample.name)
            if name == PER_POSITION:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    width = max(per_position, default=-1) + 1
    spec = {
        name.removeprefix(COUNTER_PREFIX): value
        for name, value in totals.items()
        if name.startswith(COUNTER_PREFIX)
    }
    spec["num_accepted_tokens_per_pos"] = [per_position.get(i, 0.0) for i in range(width)]
    return Reading(
        time=now,
        counters=SpecDecodeCounters.from_dict(spec),
        generation_tokens=int(totals.get(GENERATION_TOKENS, 0)),
        requests_running=totals.get(RUNNING, 0.0),
        requests_waiting=totals.get(WAITING, 0.0),
        spec_decode_enabled=COUNTER_PREFIX + "num_drafts" in totals,
    )


@dataclass(frozen=True)
class Window:
    """The figures between two readings, and whether they break the acceptance KPI."""

    seconds: float
    delta: SpecDecodeCounters
    generation_tokens: int
    requests_running: float
    requests_waiting: float
    spec_decode_enabled: bool
    threshold: float
    min_draft_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.generation_tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def status(self) -> str:
        """``alert`` under the threshold; ``idle`` with too few drafts to judge (a handful
        of tokens would flap the alert); ``no-spec`` when the server is not speculating."""
        if not self.spec_decode_enabled:
            return "no-spec"
        if self.delta.num_draft_tokens < max(self.min_draft_tokens, 1):
            return "idle"
        return "alert" if self.delta.acceptance_rate < self.threshold else "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "interval_s": round(self.seconds, 3),
            "num_drafts": self.delta.num_drafts,
            "num_draft_tokens": self.delta.num_draft_tokens,
            "num_accepted_tokens": self.delta.num_accepted_tokens,
            "acceptance_length": _finite(self.delta.acceptance_length),
            "acceptance_rate": _finite(self.delta.acceptance_rate),
            "per_position_acceptance": [_finite(p) for p in self.delta.per_position_acceptance],
            "generation_tokens": self.generation_tokens,
            "output_tokens_per_s": _finite(self.output_tokens_per_s),
            "requests_running": self.requests_running,
            "requests_waiting": self.requests_waiting,
            "threshold": self.threshold,
            "status": self.status,
            "alert": self.status == "alert",
        }


def _finite(value: float) -> float | None:
    # JSON has no NaN; an empty window reports null rather than an invalid document.
    return None if math.isnan(value) else round(value, 4)


def window(
    earlier: Reading,
    later: Reading,
    threshold: float = DEFAULT_THRESHOLD,
    min_draft_tokens: int = 1,
) -> Window:
    """Figures between two readings. A counter that went down means the server restarted;
    as Prometheus' ``rate()`` does, the later reading then counts from zero."""
    restarted = (
        later.counters.num_drafts < earlier.counters.num_drafts
        or later.generation_tokens < earlier.generation_tokens
    )
    base_counters = SpecDecodeCounters() if restarted else earlier.counters
    base_tokens = 0 if restarted else earlier.generation_tokens
    return Window(
        seconds=later.time - earlier.time,
        delta=later.counters - base_counters,
        generation_tokens=later.generation_tokens - base_tokens,
        requests_running=later.requests_running,
        requests_waiting=later.requests_waiting,
        spec_decode_enabled=later.spec_decode_enabled,
        threshold=threshold,
        min_draft_tokens=min_draft_tokens,
    )


def metrics_url(url: str) -> str:
    """``host:port`` or a server's base URL becomes its ``/metrics`` URL."""
    if "://" not in url:
        url = "http://" + url
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def watch(
    scrape: Callable[[], str],
    interval: float,
    *,
    count: int | None = None,
    duration: float | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    min_draft_tokens: int = 1,
    model_name: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Window | Exception]:
    """Yield one :class:`Window` per interval until ``count`` windows or ``duration`` seconds.

    A failed scrape is yielded as its exception and the next good scrape starts a new
    window, so a server restart shows as a gap instead of ending the watch.
    """
    start = clock()
    previous: Reading | None = None
    produced = 0
    while True:
        try:
            reading = parse_metrics(scrape(), clock(), model_name)
        except (OSError, ValueError) as err:
            previous = None
            yield err
        else:
            if previous is not None:
                produced += 1
                yield window(previous, reading, threshold, min_draft_tokens)
            previous = reading
        if count is not None and produced >= count:
            return
        if duration is not None and clock() - start + interval > duration:
            return
        sleep(interval)


def _timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def json_lines(results: Iterable[Window | Exception], out: IO[str], url: str) -> bool:
    """One JSON object per window (or failed scrape); True if any window alerted."""
    alerted = False
    for result in results:
        record: dict[str, Any] = {"time": _timestamp(), "url": url}
        if isinstance(result, Exception):
            record.update(status="error", error=str(result))
        else:
            record.update(result.to_dict())
            alerted |= result.status == "alert"
        out.write(json.dumps(record) + "\n")
        out.flush()
    return alerted


def live_table(results: Iterable[Window | Exception], url: str, keep: int = 20) -> bool:
    """A ``rich`` table of the latest ``keep`` windows, redrawn in place; True on any alert."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    rows: list[tuple[str, ...]] = []
    alerted = False

    def render() -> Table:
        table = Table(title=f"P-EAGLE spec decoding at {url}", title_justify="left")
        for column in ("time", "AL", "accept", "per position", "tok/s", "run/wait", "status"):
            table.add_column(column, justify="left" if column == "per position" else "right")
        for row in rows[-keep:]:
            table.add_row(*row)
        return table

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    with Live(render(), console=Console(), auto_refresh=False) as live:
        for result in results:
            now = datetime.now().strftime("%H:%M:%S")
            if isinstance(result, Exception):
                rows.append((now, "", "", f"[red]{result}[/]", "", "", "[red]error[/]"))
            else:
                d = result.to_dict()
                alerted |= result.status == "alert"
                colour = {"alert": "bold red", "ok": "green"}.get(result.status, "dim")
                rows.append(
                    (
                        now,
                        fmt(d["acceptance_length"], ".2f"),
                        fmt(d["acceptance_rate"], ".1%"),
                        " ".join(fmt(p, ".2f") for p in d["per_position_acceptance"]),
                        fmt(d["output_tokens_per_s"], ".1f"),
                        f"{result.requests_running:g}/{result.requests_waiting:g}",
                        f"[{colour}]{result.status.upper()}[/]",
                    )
                )
            live.update(render(), refresh=True)
    return alerted


def run(
    url: str,
    interval: float = 10.0,
    *,
    once: bool = False,
    duration: float | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    min_draft_tokens: int = 1,
    model_name: str | None = None,
    as_json: bool | None = None,
    out: IO[str] | None = None,
    scrape: Callable[[], str] | None = None,
) -> int:
    """The ``vllm-peagle monitor`` command. Exit status: 0, or 2 if any window alerted, or 1
    if no window could be measured (every scrape failed)."""
    out = sys.stdout if out is None else out
    target = metrics_url(url)
    scrape = scrape or (lambda: fetch(target, timeout=max(interval, 1.0)))
    outcome = {"windows": 0}

    def counted() -> Iterator[Window | Exception]:
        for result in watch(
            scrape,
            interval,
            count=1 if once else None,
            duration=duration,
            threshold=threshold,
            min_draft_tokens=min_draft_tokens,
            model_name=model_name,
        ):
            outcome["windows"] += not isinstance(result, Exception)
            yield result
            if once and isinstance(result, Exception):
                return

    if as_json is None:
        as_json = not out.isatty()
    try:
        alerted = json_lines(counted(), out, target) if as_json else live_table(counted(), target)
    except KeyboardInterrupt:
        return 0
    if alerted:
        return 2
    return 0 if outcome["windows"] else 1
