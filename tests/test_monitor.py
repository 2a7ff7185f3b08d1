"""`vllm-peagle monitor`: figures from two /metrics scrapes, alerting, and its output formats.

The scrapes are rendered by a real prometheus_client registry holding vLLM's metric names and
labels (vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py), so the parser meets
the exposition format a server writes: `_total` counters, `_created` samples, two engines.
"""

from __future__ import annotations

import io
import json
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from vllm_peagle import monitor
from vllm_peagle.cli import build_parser
from vllm_peagle.monitor import parse_metrics, window

LABELS = ["model_name", "engine"]
MODEL = "Qwen/Qwen3-8B"


class FakeServer:
    """vLLM's metrics for a server with K draft positions and two data-parallel engines."""

    def __init__(self, k: int = 3, spec_decode: bool = True) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, labels: list[str] = LABELS) -> Counter:
            metric = Counter(name, name, labels, registry=self.registry)
            if labels == LABELS:  # vLLM creates each engine's child up front (zeros show)
                for engine in ("0", "1"):
                    metric.labels(MODEL, engine)
            return metric

        self.generation = counter("vllm:generation_tokens")
        self.running = Gauge("vllm:num_requests_running", "", LABELS, registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "", LABELS, registry=self.registry)
        self.k = k
        self.spec_decode = spec_decode
        if spec_decode:
            self.drafts = counter("vllm:spec_decode_num_drafts")
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens")
            self.accepted = counter("vllm:spec_decode_num_accepted_tokens")
            self.per_pos = counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos", [*LABELS, "position"]
            )
            for engine in ("0", "1"):  # vLLM creates every position's counter up front
                for pos in range(k):
                    self.per_pos.labels(MODEL, engine, str(pos))

    def step(self, engine: str, drafts: int, accepted_per_pos: list[int], tokens: int) -> None:
        if self.spec_decode:
            self.drafts.labels(MODEL, engine).inc(drafts)
            self.draft_tokens.labels(MODEL, engine).inc(drafts * self.k)
            self.accepted.labels(MODEL, engine).inc(sum(accepted_per_pos))
            for pos, n in enumerate(accepted_per_pos):
                self.per_pos.labels(MODEL, engine, str(pos)).inc(n)
        self.generation.labels(MODEL, engine).inc(tokens)

    def queue(self, running: int, waiting: int) -> None:
        self.running.labels(MODEL, "0").set(running)
        self.waiting.labels(MODEL, "0").set(waiting)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_parse_sums_engines_and_groups_positions():
    server = FakeServer()
    server.step("0", drafts=10, accepted_per_pos=[9, 8, 6], tokens=33)
    server.step("1", drafts=10, accepted_per_pos=[10, 7, 5], tokens=32)
    server.queue(running=4, waiting=2)
    text = server.text()
    assert "vllm:spec_decode_num_drafts_total{" in text  # the exposition the parser meets
    reading = parse_metrics(text, now=5.0)
    assert reading.counters.num_drafts == 20
    assert reading.counters.num_draft_tokens == 60
    assert reading.counters.num_accepted_tokens == 45
    assert reading.counters.accepted_per_position == (19, 15, 11)
    assert reading.generation_tokens == 65
    assert (reading.requests_running, reading.requests_waiting) == (4, 2)
    assert reading.spec_decode_enabled


def test_window_figures_and_alert():
    server = FakeServer()
    server.step("0", drafts=100, accepted_per_pos=[90, 80, 70], tokens=340)  # before: 0.8
    before = parse_metrics(server.text(), now=100.0)
    # In the window: 40 drafts x 3 tokens; accepted 30 + 20 + 10 = 60 -> rate 0.5, AL 2.5.
    server.step("0", drafts=20, accepted_per_pos=[16, 11, 6], tokens=53)
    server.step("1", drafts=20, accepted_per_pos=[14, 9, 4], tokens=47)
    after = parse_metrics(server.text(), now=110.0)
    w = window(before, after)
    assert w.seconds == 10.0
    assert (w.delta.num_drafts, w.delta.num_draft_tokens, w.delta.num_accepted_tokens) == (
        40,
        120,
        60,
    )
    assert w.delta.acceptance_length == pytest.approx(2.5)
    assert w.delta.acceptance_rate == pytest.approx(0.5)
    assert w.delta.per_position_acceptance == pytest.approx((0.75, 0.5, 0.25))
    assert w.output_tokens_per_s == pytest.approx(10.0)
    assert w.status == "alert"
    assert window(before, after, threshold=0.4).status == "ok"


def test_idle_no_spec_and_restart():
    server = FakeServer()
    server.step("0", drafts=5, accepted_per_pos=[1, 0, 0], tokens=6)
    first = parse_metrics(server.text(), now=0.0)
    # Nothing drafted in the window: no figures, no alert.
    idle = window(first, parse_metrics(server.text(), now=1.0))
    assert idle.status == "idle" and math.isnan(idle.delta.acceptance_rate)
    # Too few draft tokens to judge (15 < 20) even though the rate is low.
    server.step("0", drafts=5, accepted_per_pos=[1, 0, 0], tokens=6)
    assert window(first, parse_metrics(server.text(), now=1.0), min_draft_tokens=20).status == (
        "idle"
    )
    # A restarted server (counters went down) counts from zero, like Prometheus' rate().
    restarted = FakeServer()
    restarted.step("0", drafts=4, accepted_per_pos=[4, 4, 4], tokens=16)
    w = window(parse_metrics(server.text(), now=0.0), parse_metrics(restarted.text(), now=2.0))
    assert (w.delta.num_drafts, w.generation_tokens, w.status) == (4, 16, "ok")
    # A server without --speculative-config has no spec-decode counters at all.
    plain = FakeServer(spec_decode=False)
    plain.step("0", drafts=0, accepted_per_pos=[], tokens=10)
    reading = parse_metrics(plain.text(), now=0.0)
    assert not reading.spec_decode_enabled
    assert window(reading, reading).status == "no-spec"


def test_handwritten_exposition_without_type_lines():
    # A proxy or an older client may drop HELP/TYPE lines; samples still carry the names.
    text = (
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 12\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 18\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 40\n'
        'vllm:generation_tokens_total{engine="0",model_name="other"} 1000\n'
    )
    reading = parse_metrics(text, now=0.0, model_name="m")
    assert reading.counters.accepted_per_position == (18, 12)
    assert reading.counters.acceptance_length == pytest.approx(4.0)
    assert reading.generation_tokens == 40


def scripted(server: FakeServer, steps: list[tuple[int, list[int], int]]):
    """A scrape function: each call first applies the next step, then renders /metrics."""
    pending = iter([None, *steps])

    def scrape() -> str:
        step = next(pending, None)
        if step is not None:
            drafts, accepted, tokens = step
            server.step("0", drafts, accepted, tokens)
        return server.text()

    return scrape


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_watch_is_bounded_by_count_and_duration():
    clock = Clock()
    scrape = scripted(FakeServer(), [(10, [9, 9, 9], 40)] * 10)
    common = {"clock": clock, "sleep": clock.sleep}
    assert len(list(monitor.watch(scrape, 5.0, count=3, **common))) == 3
    clock.now = 0.0
    results = list(monitor.watch(scrape, 5.0, duration=22.0, **common))
    assert len(results) == 4  # scrapes at 0, 5, 10, 15, 20 -> four windows
    assert all(r.seconds == 5.0 for r in results)


def test_failed_scrape_is_reported_and_the_watch_goes_on():
    clock = Clock()
    server = FakeServer()
    replies = iter(["text", "fail", "text", "text"])

    def scrape() -> str:
        if next(replies) == "fail":
            raise ConnectionRefusedError("connection refused")
        server.step("0", 10, [10, 10, 10], 40)
        return server.text()

    results = list(monitor.watch(scrape, 1.0, count=1, clock=clock, sleep=clock.sleep))
    assert isinstance(results[0], ConnectionRefusedError)
    # After a gap a new window starts: the one reported spans only good scrapes.
    assert len(results) == 2 and results[1].seconds == 1.0


def test_json_lines_output_and_exit_status():
    out = io.StringIO()
    scrape = scripted(FakeServer(), [(10, [10, 9, 8], 37)])
    status = monitor.run("localhost:8000", 0.0, once=True, out=out, scrape=scrape)
    (record,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert status == 0  # StringIO is not a terminal: JSON lines without --json
    assert record["url"] == "http://localhost:8000/metrics"
    assert record["acceptance_rate"] == pytest.approx(0.9)
    assert record["acceptance_length"] == pytest.approx(3.7)
    assert record["per_position_acceptance"] == pytest.approx([1.0, 0.9, 0.8])
    assert record["status"] == "ok" and record["alert"] is False
    assert {"time", "interval_s", "output_tokens_per_s", "requests_waiting"} <= record.keys()

    out = io.StringIO()
    scrape = scripted(FakeServer(), [(10, [5, 2, 0], 17)])
    assert monitor.run("localhost:8000", 0.0, once=True, out=out, scrape=scrape) == 2
    assert json.loads(out.getvalue())["alert"] is True  # 7 of 30 accepted


def test_json_lines_over_several_windows():
    clock = Clock()
    scrape = scripted(FakeServer(), [(10, [10, 9, 8], 37), (10, [5, 2, 0], 17)])
    out = io.StringIO()
    results = monitor.watch(scrape, 5.0, count=2, clock=clock, sleep=clock.sleep)
    assert monitor.json_lines(results, out, "u") is True
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["status"] for r in records] == ["ok", "alert"]
    assert records[1]["acceptance_rate"] == pytest.approx(7 / 30, abs=1e-4)
    assert records[1]["output_tokens_per_s"] == pytest.approx(17 / 5)


def test_empty_window_is_valid_json():
    out = io.StringIO()
    server = FakeServer()
    status = monitor.run("http://h:1/metrics", 0.0, once=True, out=out, scrape=server.text)
    record = json.loads(out.getvalue())
    assert status == 0 and record["status"] == "idle"
    assert record["acceptance_rate"] is None and record["per_position_acceptance"] == []


def test_unreachable_server_exits_1():
    out = io.StringIO()

    def scrape() -> str:
        raise OSError("no route to host")

    assert monitor.run("h:1", 0.0, once=True, out=out, scrape=scrape) == 1
    assert json.loads(out.getvalue())["status"] == "error"


def test_live_table_renders(capsys):
    scrape = scripted(FakeServer(), [(10, [10, 9, 8], 37), (10, [5, 2, 0], 17)])
    results = monitor.watch(scrape, 0.0, count=2, sleep=lambda s: None)
    assert monitor.live_table(results, "http://h:1/metrics") is True
    shown = capsys.readouterr().out
    assert "ALERT" in shown and "0.90" in shown


def test_cli_subcommand():
    args = build_parser().parse_args(["monitor", "h:8000", "--once", "--json", "--interval", "2"])
    assert (args.url, args.once, args.json, args.interval) == ("h:8000", True, True, 2.0)
    assert args.threshold == monitor.DEFAULT_THRESHOLD and args.duration is None
