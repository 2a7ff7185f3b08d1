"""``benchmarks/RESULTS.md`` from the JSON the sweeps wrote: every figure in it is computed here.

    python -m vllm_peagle.bench.results [--dir benchmarks]

Reads ``cpu.json`` (methods: none / EAGLE-3 / upstream P-EAGLE / ours at each K),
``cpu_adaptive.json`` (adaptive K beside every fixed K), and, when present, ``cpu_build.json``
(benchmark model build time) and ``cpu_stepcost.md`` (where a step's time goes); ``--prefix
gpu`` reads the ``gpu*`` files instead. Run by ``scripts/bench_cpu.sh`` (and ``bench_gpu.sh``)
after the sweeps; safe to re-run on its own.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_peagle.bench.configs import fixed_k, label
from vllm_peagle.bench.stats import median, median_interval, same_round_ratios

ADAPTIVE_RATIO = "adaptive/best fixed"


def _x(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}×"


def _mode(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def _ratio(row: dict[str, Any], name: str) -> float | None:
    entry = row["ratios"].get(name)
    return None if entry is None else entry["median"]


def _rows(doc: dict[str, Any], concurrency: int | None = None) -> list[dict[str, Any]]:
    rows = doc["summary"]
    return [r for r in rows if concurrency is None or r["concurrency"] == concurrency]


def _verdict(values: Iterable[float | None], goal: float, at_most: bool = False) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "not measured"
    met = sum((v <= goal) if at_most else (v >= goal) for v in values)
    return "**met**" if met == len(values) else f"**missed** (met in {met} of {len(values)})"


def provenance_lines(doc: dict[str, Any]) -> list[str]:
    p = doc["provenance"]
    machine = p["machine"]
    load = ", ".join(f"{v:.1f}" for v in (machine.get("load_average") or [])[:3]) or "?"
    rebuilt = p.get("rebuilt")
    # Sweeps before the start record read the machine when they finished.
    load = f"load average {p.get('recorded', 'when it finished')} {load}"
    if rebuilt is None:
        when = f"{load}; the sweep took {p.get('sweep_seconds', 0):.0f} s"
    else:
        repeats = rebuilt["repeats"]
        planned = doc["settings"].get("repeats", "?")
        cells = len(doc["summary"]) * len(doc["settings"].get("configs", ()))
        held = (
            f"the {rebuilt['runs']} runs of all {planned} repeats"
            if isinstance(planned, int) and rebuilt["runs"] == planned * cells
            else f"the {rebuilt['runs']} runs of its complete rounds, {len(repeats)} of "
            f"{planned} repeats (stopped before it finished)"
        )
        when = f"outputs rebuilt {rebuilt['time_utc']} (`{rebuilt['command']}`) from {held}" + (
            f"; {load}"
            if rebuilt["start_recorded"]
            else f"; the sweep's start was not recorded, so the time, commit, versions and "
            f"{load} are the rebuild's"
        )
    return [
        "```bash",
        p["command"],
        "```",
        "",
        f"Run {p['time_utc']} at commit `{(p.get('git_commit') or '?')[:10]}`"
        f"{' (uncommitted changes)' if p.get('git_dirty') else ''}, "
        f"{machine['cpu_count']} × {machine['cpu']}, {when}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in p["versions"].items() if v)
        + ".",
    ]


def methods_section(doc: dict[str, Any]) -> list[str]:
    lines = ["## Methods at concurrency 1 (same-round medians)", ""]
    lines += [*provenance_lines(doc), ""]
    head = (
        "| K | T | ours / none | ours / EAGLE-3 | ours / upstream | EAGLE-3 / none "
        "| AL ours | AL EAGLE-3 | ours step / plain step |"
    )
    lines += [head, "|---|---|---|---|---|---|---|---|---|"]
    c1 = sorted(_rows(doc, 1), key=lambda r: (r["temperature"], r["k"]))
    for r in c1:
        ours, eagle = r["configs"].get("peagle", {}), r["configs"].get("eagle3", {})
        lines.append(
            f"| {r['k']} | {_mode(r['temperature'])} | {_x(_ratio(r, 'peagle/none'))} "
            f"| {_x(_ratio(r, 'peagle/eagle3'))} | {_x(_ratio(r, 'peagle/upstream'))} "
            f"| {_x(_ratio(r, 'eagle3/none'))} | {ours.get('acceptance_length', 0):.2f} "
            f"| {eagle.get('acceptance_length', 0):.2f} "
            f"| {ours.get('step_cost_vs_plain') or math.nan:.2f} |"
        )
    k7 = [r for r in c1 if r["k"] == 7 and "peagle" in r["configs"]]
    lines += [
        "",
        "Against the targets of issue #5, over the rows above:",
        "",
        f"- ours ≥ 2.0× no speculation: {_verdict((_ratio(r, 'peagle/none') for r in c1), 2.0)}.",
        f"- ours ≥ 1.3× EAGLE-3: {_verdict((_ratio(r, 'peagle/eagle3') for r in c1), 1.3)}.",
        "- ours ≥ 1.00× upstream P-EAGLE (same checkpoint and K): "
        f"{_verdict((_ratio(r, 'peagle/upstream') for r in c1), 1.0)}; every repeat's ratio: "
        + "; ".join(
            f"K={r['k']} {_mode(r['temperature'])} "
            + " ".join(f"{v:.2f}" for v in r["ratios"].get("peagle/upstream", {}).get("runs", []))
            for r in c1
        )
        + ".",
        "- a step at K=7 ≤ 1.4× a plain step: "
        + _verdict((r["configs"]["peagle"]["step_cost_vs_plain"] for r in k7), 1.4, at_most=True)
        + " ("
        + ", ".join(
            f"{r['configs']['peagle']['step_cost_vs_plain']:.2f}× {_mode(r['temperature'])}"
            for r in k7
        )
        + ").",
        "",
        "Ours over no speculation at every concurrency (the full tables, with TPOT p50/p99, "
        "TTFT, AL and per-position acceptance, are in [`cpu.md`](cpu.md)):",
        "",
    ]
    concurrency = sorted({r["concurrency"] for r in _rows(doc)})
    groups = sorted({(r["k"], r["temperature"]) for r in _rows(doc)})
    lines += [
        "| K | T | " + " | ".join(f"c={c}" for c in concurrency) + " |",
        "|---|---|" + "---|" * len(concurrency),
    ]
    for k, t in groups:
        by_c = {r["concurrency"]: r for r in _rows(doc) if r["k"] == k and r["temperature"] == t}
        cells = [_x(_ratio(by_c[c], "peagle/none")) if c in by_c else "-" for c in concurrency]
        lines.append(f"| {k} | {_mode(t)} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def adaptive_section(doc: dict[str, Any]) -> list[str]:
    lines = ["## Adaptive K against every fixed K (same-round medians)", ""]
    lines += [*provenance_lines(doc), ""]
    names = list(doc["settings"]["configs"])
    shown = [n for n in names if n != "adaptive"]
    ratios: list[tuple[float, dict[str, Any]]] = []
    for t in sorted({r["temperature"] for r in _rows(doc)}):
        lines += [f"### {_mode(t)}", ""]
        head = ["c", *(f"{label(n)} tok/s" for n in shown), "adaptive tok/s", "adaptive / best"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in sorted(
            (r for r in _rows(doc) if r["temperature"] == t), key=lambda r: r["concurrency"]
        ):
            entry = r["ratios"].get(ADAPTIVE_RATIO)
            cells = [str(r["concurrency"])]
            cells += [f"{r['configs'][n]['output_tok_s']:.1f}" for n in shown]
            cells.append(f"{r['configs']['adaptive']['output_tok_s']:.1f}")
            if entry is not None and entry["median"] is not None:
                ratios.append((entry["median"], r))
                interval = median_interval(entry["runs"])
                spread = f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""
                cells.append(f"{_x(entry['median'])}{spread} vs {label(entry['best'])}")
            else:
                cells.append("-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if ratios:
        worst, row = min(ratios, key=lambda item: item[0])
        c1 = [v for v, r in ratios if r["concurrency"] == 1]
        c1_fixed = [_c1_against_fixed(r) for r in _rows(doc, 1) if _c1_against_fixed(r) is not None]
        lines += [
            f"Worst case over every concurrency and temperature: **{worst:.2f}×** "
            f"(c={row['concurrency']}, {_mode(row['temperature'])}, against "
            f"{label(row['ratios'][ADAPTIVE_RATIO]['best'])}). Against the targets of issue #6:",
            "",
            f"- adaptive ≥ 0.97 × max(no speculation, best fixed K) at every concurrency: "
            f"{_verdict((v for v, _ in ratios), 0.97)}.",
            f"- within 3 % of the best fixed K at concurrency 1: "
            f"{_verdict(c1_fixed, 0.97)} ("
            + ", ".join(f"{v:.2f}×" for v in c1_fixed)
            + "; against the best choice including no speculation: "
            + ", ".join(f"{v:.2f}×" for v in c1)
            + ").",
            "",
            *_uncertainty_lines(ratios, 0.97),
            *_same_work_lines(ratios),
        ]
    return lines


def _order_statistics(n: int) -> str:
    """Which of n sorted values bound :func:`median_interval`, in words."""
    interval = median_interval(list(range(n)))
    rank = 1 if interval is None else int(interval[0]) + 1
    if rank == 1:
        return "the smallest to the largest"
    nth = {2: "2nd", 3: "3rd"}.get(rank, f"{rank}th")
    return f"the {nth} smallest to the {nth} largest"


def _same_work_lines(ratios: list[tuple[float, dict[str, Any]]]) -> list[str]:
    """The cells where adaptive drafted exactly what the best configuration drafted.

    There the policy's choices cost what the best configuration's cost, so the spread of
    their same-round ratios shows what this machine's noise does to a ratio at these run
    lengths (for no speculation, plus whatever a speculative engine spends on steps that
    draft nothing).
    """
    same: list[tuple[float, dict[str, Any]]] = []
    for value, row in ratios:
        best = row["ratios"][ADAPTIVE_RATIO]["best"]
        adaptive_drafts = row["configs"]["adaptive"].get("draft_tokens_runs")
        if adaptive_drafts is not None and adaptive_drafts == row["configs"][best].get(
            "draft_tokens_runs"
        ):
            same.append((value, row))
    if not same:
        return []
    runs = [v for _, row in same for v in row["ratios"][ADAPTIVE_RATIO]["runs"]]
    cells = ", ".join(
        f"c={row['concurrency']} {_mode(row['temperature'])} {value:.2f}×" for value, row in same
    )
    return [
        f"Same drafting as the best configuration: in {len(same)} of {len(ratios)} cells "
        f"adaptive drafted exactly as many tokens as the best configuration in every repeat "
        f"({cells}); their {len(runs)} same-round ratios span {min(runs):.2f}× to "
        f"{max(runs):.2f}× (median {median(runs):.2f}×), the noise of a ratio at these run "
        f"lengths (against no speculation it also holds what a speculative engine spends on "
        f"steps that draft nothing).",
        "",
    ]


def _uncertainty_lines(ratios: list[tuple[float, dict[str, Any]]], goal: float) -> list[str]:
    """Which cells' misses the repeats can tell from noise, by the median's interval."""
    sizes, clear, unclear = set(), [], []
    for value, row in ratios:
        runs = row["ratios"][ADAPTIVE_RATIO]["runs"]
        interval = median_interval(runs)
        if interval is None:
            continue
        sizes.add((len(runs), round(100 * interval[2])))
        where = f"c={row['concurrency']} {_mode(row['temperature'])} {value:.3f}×"
        if interval[1] < goal:
            clear.append(where)
        elif value < goal:
            unclear.append(where)
    if not sizes:
        return []
    described = "; ".join(
        f"with {n} repeats {_order_statistics(n)}, {c} %" for n, c in sorted(sizes)
    )
    return [
        f"In brackets: an interval of order statistics of the repeats' same-round ratios "
        f"that holds the cell's true median ratio with a probability that does not depend on "
        f"how the noise is distributed ({described}). Below {goal:.2f}× with the whole "
        f"interval below too: "
        f"{', '.join(clear) or 'none'}; below {goal:.2f}× by the median only, the interval "
        f"reaching {goal:.2f}×: {', '.join(unclear) or 'none'}.",
        "",
    ]


def _c1_against_fixed(row: dict[str, Any]) -> float | None:
    """Adaptive over the best *speculative* fixed K (by median) of a row, same-round median."""
    fixed = [n for n in row["configs"] if fixed_k(n) is not None or n == "peagle"]
    if "adaptive" not in row["configs"] or not fixed:
        return None
    best = max(fixed, key=lambda n: row["configs"][n]["output_tok_s"])
    runs = [
        {"repeat": i, "config": name, "output_tok_s": value}
        for name in ("adaptive", best)
        for i, value in enumerate(row["configs"][name]["output_tok_s_runs"])
    ]
    return median(same_round_ratios(runs, "adaptive", best))


def build_section(build: dict[str, Any] | None) -> list[str]:
    if build is None:
        return []
    return [
        "## Benchmark models",
        "",
        "`python scripts/build_bench_models.py` builds a Llama target (8 layers, hidden 512, "
        "vocab 4096) trained from scratch on stdlib sources, and P-EAGLE and EAGLE-3 drafters "
        "(K=7) trained with our trainer on the same data; upstream P-EAGLE and ours serve the "
        "same P-EAGLE checkpoint. The target is small and undertrained (held-out loss "
        f"{build.get('target_heldout_loss', math.nan):.2f} nats; ln 4096 = 8.32): its greedy "
        "continuations repeat, which flatters greedy acceptance, and its T=0.7 distribution is "
        "nearly flat, so sampled acceptance is low. It is here for its cost structure.",
        "",
        f"Build time: {build.get('total_seconds_this_run', math.nan):.0f} s in all, target "
        f"{build.get('target_build_seconds', math.nan):.0f} s ({build.get('note', '')}).",
        "",
    ]


def render(directory: Path, prefix: str = "cpu") -> str:
    def load(name: str) -> dict[str, Any] | None:
        path = directory / f"{prefix}{name}"
        return json.loads(path.read_text()) if path.is_file() else None

    methods, adaptive, build = load(".json"), load("_adaptive.json"), load("_build.json")
    lines = [
        f"# Benchmark results ({prefix.upper()})",
        "",
        "Generated by `python -m vllm_peagle.bench.results` from the JSON below; "
        f"`bash scripts/bench_{prefix}.sh` reruns everything (models, both sweeps, the step "
        "breakdown, this page). Every ratio is the median over repeats of a ratio taken "
        "**within** one repeat, where the configurations ran back to back (round-robin, in an "
        "order that changes per repeat): absolute tok/s on a shared 2-core machine swing from "
        "minute to minute, ratios taken side by side much less. Each temperature starts with a "
        "discarded warm-up at that temperature for every server, so adaptive K is measured in "
        "steady state (how fast it re-adapts is tested in `tests/test_adaptive_engine.py`).",
        "",
    ]
    lines += [
        "How to read these numbers: on this CPU a target forward is compute-bound, so verifying "
        "K+1 tokens per request costs nearly K+1 plain steps once the batch is large, and "
        "speculation of any method loses at high concurrency; on a GPU at small batches the "
        "forward is memory-bound and verification is nearly free, which is where P-EAGLE's "
        "published gains come from. Output lengths are short (CPU time), so at high "
        "concurrency and high acceptance a run is mostly prompt processing, which for the "
        "speculative methods includes the drafter's pass over every prompt.",
        "",
    ]
    lines += build_section(build)
    if methods is not None:
        lines += methods_section(methods)
    if adaptive is not None:
        lines += adaptive_section(adaptive)
    stepcost = directory / f"{prefix}_stepcost.md"
    if stepcost.is_file():
        lines += [
            "## Where the time of a step goes (c=1)",
            "",
            # Only the tables: vLLM's own log lines can share the stream it was captured from.
            "\n".join(
                line if line.startswith("|") else f"\n{line}\n"
                for line in stepcost.read_text().splitlines()
                if line.startswith(("|", "K="))
            ).strip(),
            "",
        ]
    if prefix == "cpu":
        gpu_page = directory / "gpu" / "RESULTS.md"
        lines += [
            "## GPU",
            "",
            "`bash scripts/bench_gpu.sh` runs both sweeps on one CUDA GPU (CUDA build of vLLM, "
            "bf16, CUDA graphs) into `benchmarks/gpu/`, with its own RESULTS.md: "
            + (
                "see [`gpu/RESULTS.md`](gpu/RESULTS.md)."
                if gpu_page.is_file()
                else "not run yet (no session so far was lent a GPU)."
            ),
            "",
        ]
    lines += [
        "Files: "
        + ", ".join(
            f"[`{prefix}{name}`]({prefix}{name})"
            for name in (
                ".json",
                ".md",
                "_throughput.png",
                "_acceptance.png",
                "_adaptive.json",
                "_adaptive.md",
                "_adaptive_throughput.png",
            )
            if (directory / f"{prefix}{name}").is_file()
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("benchmarks"))
    parser.add_argument("--prefix", default="cpu", help="file stem of the sweeps (cpu, gpu)")
    args = parser.parse_args(argv)
    p = args.prefix
    if not (args.dir / f"{p}.json").is_file() and not (args.dir / f"{p}_adaptive.json").is_file():
        parser.error(f"no {p}.json or {p}_adaptive.json in {args.dir}: run scripts/bench_{p}.sh")
    out = args.dir / "RESULTS.md"
    out.write_text(render(args.dir, p))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
