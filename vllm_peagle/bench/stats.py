"""Statistics of benchmark runs: percentiles, per-run summaries and same-round ratios.

Pure functions over plain data (no server), so the table and JSON code is unit-testable.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_peagle.bench.load import LoadResult
from vllm_peagle.metrics import SpecDecodeCounters


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_run(load: LoadResult, delta: SpecDecodeCounters | None) -> dict[str, Any]:
    """Figures of one run: throughput, latency percentiles and (when speculating)
    acceptance from the server's counter delta over the run."""
    ok = [r for r in load.requests if r.error is None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    summary: dict[str, Any] = {
        "requests": len(load.requests),
        "errors": len(load.errors),
        "output_tokens": load.output_tokens,
        "wall_s": load.wall_s,
        "output_tok_s": load.output_tokens / load.wall_s if load.wall_s > 0 else math.nan,
        "tpot_ms_p50": 1e3 * percentile(tpots, 50),
        "tpot_ms_p99": 1e3 * percentile(tpots, 99),
        "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else math.nan,
        "ttft_ms_p50": 1e3 * percentile([r.ttft_s for r in ok], 50),
        "tpot_s": tpots,
    }
    if delta is not None:
        summary.update(
            num_drafts=delta.num_drafts,
            num_draft_tokens=delta.num_draft_tokens,
            num_accepted_tokens=delta.num_accepted_tokens,
            accepted_per_position=list(delta.accepted_per_position),
            acceptance_length=delta.acceptance_length,
            per_position_acceptance=list(delta.per_position_acceptance),
        )
    return summary


def median(values: Iterable[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def median_interval(
    values: Sequence[float], confidence: float = 0.9
) -> tuple[float, float, float] | None:
    """A distribution-free interval for the median of what ``values`` sample: ``(low, high,
    coverage)``, or None when there are too few values for ``confidence``.

    The median lies below the j-th smallest of n values with probability P(Binomial(n, ½) ≥
    j), whatever the distribution, so ``[x_(j), x_(n+1-j)]`` covers it with probability
    1 − 2·P(Binomial(n, ½) < j); j is the largest that keeps this ≥ ``confidence``. With 8
    repeats that is the 2nd smallest to the 2nd largest (93 %).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    ordered = sorted(v for v in values if not math.isnan(v))
    n = len(ordered)
    below = 0.0  # P(Binomial(n, 1/2) < j)
    j = 0
    while j < n // 2:
        below_next = below + math.comb(n, j) / 2**n
        if 1 - 2 * below_next < confidence:
            break
        below, j = below_next, j + 1
    if j == 0:
        return None
    return ordered[j - 1], ordered[n - j], 1 - 2 * below


def same_round_ratios(
    runs: Sequence[dict[str, Any]], numerator: str, denominator: str, key: str = "output_tok_s"
) -> list[float]:
    """``key`` of ``numerator`` over ``denominator``, one ratio per repeat in which both ran.

    Runs of one repeat were interleaved (round-robin), so each ratio compares measurements
    taken under the same machine load; the noise of a shared machine cancels in them far
    better than in a ratio of two medians taken at different times.
    """
    by_repeat: dict[int, dict[str, float]] = {}
    for run in runs:
        by_repeat.setdefault(run["repeat"], {})[run["config"]] = run[key]
    return [
        values[numerator] / values[denominator]
        for _, values in sorted(by_repeat.items())
        if numerator in values and denominator in values and values[denominator] > 0
    ]


def complete_rounds(
    records: Sequence[dict[str, Any]], names: Sequence[str]
) -> list[dict[str, Any]]:
    """The runs of rounds in which every configuration of ``names`` ran (a round: one K,
    temperature, concurrency and repeat). An interrupted sweep stops inside a round; its
    partial round would give some configurations one more run than the rest."""
    key = ("k", "temperature", "concurrency", "repeat")
    seen: dict[tuple, set[str]] = {}
    for record in records:
        seen.setdefault(tuple(record[f] for f in key), set()).add(record["config"])
    return [r for r in records if seen[tuple(r[f] for f in key)] >= set(names)]


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration at one (K, temperature, concurrency) over its repeats: medians of
    per-run figures, latency percentiles over all requests, acceptance over all runs."""
    tpots = [t for run in runs for t in run["tpot_s"]]
    out: dict[str, Any] = {
        "repeats": len(runs),
        "output_tokens": [run["output_tokens"] for run in runs],
        "output_tok_s": median(run["output_tok_s"] for run in runs),
        "output_tok_s_runs": [run["output_tok_s"] for run in runs],
        "draft_tokens_runs": [run.get("num_draft_tokens", 0) for run in runs],
        "tpot_ms_p50": 1e3 * percentile(tpots, 50),
        "tpot_ms_p99": 1e3 * percentile(tpots, 99),
        "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else math.nan,
        "ttft_ms_p50": median(run["ttft_ms_p50"] for run in runs),
        "errors": sum(run["errors"] for run in runs),
    }
    if all("num_drafts" in run for run in runs):
        width = max(len(run["accepted_per_position"]) for run in runs)
        total = SpecDecodeCounters(
            num_drafts=sum(run["num_drafts"] for run in runs),
            num_draft_tokens=sum(run["num_draft_tokens"] for run in runs),
            num_accepted_tokens=sum(run["num_accepted_tokens"] for run in runs),
            accepted_per_position=tuple(
                sum(
                    run["accepted_per_position"][i]
                    for run in runs
                    if i < len(run["accepted_per_position"])
                )
                for i in range(width)
            ),
        )
        out["acceptance_length"] = total.acceptance_length
        out["per_position_acceptance"] = list(total.per_position_acceptance)
        # At concurrency 1 each target step emits AL tokens, so TPOT x AL is the time of one
        # step including drafting; compared with plain decoding's TPOT it is the step cost.
        out["step_ms"] = out["tpot_ms_mean"] * total.acceptance_length
    else:
        out["acceptance_length"] = 1.0
        out["step_ms"] = out["tpot_ms_mean"]
    return out
