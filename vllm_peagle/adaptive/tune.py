"""``vllm-peagle tune``: a static K-per-batch-size table from a measured profile.

For users of stock vLLM (or of ours with ``"adaptive": false``): the best K at each measured
concurrency becomes ``num_speculative_tokens_per_batch_size``, the table vLLM's scheduler
reads through ``dynamic_sd_lookup``. K = 0 (no speculation won) is a valid entry there.

A profile is the JSON ``vllm-peagle bench`` writes, or a plain list of measurements
``[{"concurrency": 1, "k": 4, "output_tok_s": 512.0}, ...]`` with ``k`` 0 for no speculation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

Measurement = tuple[int, int, float]
"""(concurrency, K, output tokens per second); K = 0 is decoding without speculation."""


class ProfileError(ValueError):
    """A profile that cannot yield a schedule; the message names the fix."""


def measurements_from_bench(
    doc: Mapping[str, Any], method: str = "peagle", temperature: float | None = None
) -> list[Measurement]:
    """Fixed-K rows of ``method`` and the no-speculation rows of a ``vllm-peagle bench`` JSON."""
    rows = doc.get("summary")
    if not isinstance(rows, list):
        raise ProfileError("profile has no 'summary' list. Fix: pass the JSON `bench` wrote.")
    temperatures = sorted({row["temperature"] for row in rows})
    if temperature is None:
        temperature = temperatures[0] if temperatures else 0.0
    out: list[Measurement] = []
    for row in rows:
        if row["temperature"] != temperature:
            continue
        configs = row.get("configs", {})
        for name, k in ((method, row["k"]), ("none", 0)):
            tok_s = configs.get(name, {}).get("output_tok_s")
            if tok_s is not None and not math.isnan(tok_s):
                out.append((int(row["concurrency"]), int(k), float(tok_s)))
    if not out:
        raise ProfileError(
            f"profile has no '{method}' or 'none' rows at temperature {temperature} "
            f"(temperatures present: {temperatures}). Fix: choose --method/--temperature."
        )
    return out


def load_profile(
    path: str | Path, method: str = "peagle", temperature: float | None = None
) -> list[Measurement]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(
            f"profile {path} does not exist. Fix: run `vllm-peagle bench`."
        ) from None
    except json.JSONDecodeError as error:
        raise ProfileError(
            f"profile {path} is not JSON ({error}). Fix: pass bench's JSON."
        ) from None
    if isinstance(doc, list):
        try:
            return [(int(m["concurrency"]), int(m["k"]), float(m["output_tok_s"])) for m in doc]
        except (KeyError, TypeError, ValueError):
            raise ProfileError(
                f"profile {path}: each entry needs concurrency, k and output_tok_s. "
                "Fix: correct the entries or pass bench's JSON."
            ) from None
    return measurements_from_bench(doc, method, temperature)


def best_k_per_concurrency(measurements: Iterable[Measurement]) -> dict[int, int]:
    """The fastest K at each concurrency (repeats of one K averaged; the smaller K on ties)."""
    sums: dict[tuple[int, int], list[float]] = {}
    for concurrency, k, tok_s in measurements:
        sums.setdefault((concurrency, k), []).append(tok_s)
    best: dict[int, tuple[float, int]] = {}
    for (concurrency, k), values in sorted(sums.items()):
        mean = sum(values) / len(values)
        if concurrency not in best or mean > best[concurrency][0]:
            best[concurrency] = (mean, k)
    return {c: k for c, (_, k) in sorted(best.items())}


def schedule_from_best_k(best: Mapping[int, int], max_batch_size: int = 1024) -> list[list[int]]:
    """``[[first batch size, last batch size, K], ...]`` covering 1..max_batch_size.

    Between two measured concurrencies the switch happens at their geometric mean, since
    throughput curves are roughly linear in log(concurrency); ranges with equal K merge.
    """
    if not best:
        raise ProfileError("profile has no measurements. Fix: run `vllm-peagle bench` first.")
    levels = sorted(best)
    ranges: list[list[int]] = []
    start = 1
    for i, level in enumerate(levels):
        end = (
            max_batch_size
            if i == len(levels) - 1
            else max(start, math.isqrt(level * levels[i + 1]))
        )
        if ranges and ranges[-1][2] == best[level]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, best[level]])
        start = end + 1
        if start > max_batch_size:
            break
    return ranges


def speculative_config_snippet(
    schedule: list[list[int]], model: str | None = None, engine: str = "vllm"
) -> dict[str, Any]:
    """A ``--speculative-config`` carrying the schedule; its K is the table's largest K.

    ``engine="vllm"``: stock vLLM's P-EAGLE path (``eagle3`` + ``parallel_drafting``);
    ``engine="peagle"``: our method with adaptive K off, so the table is what runs.
    """
    snippet: dict[str, Any] = (
        {"method": "eagle3", "parallel_drafting": True}
        if engine == "vllm"
        else {"method": "peagle", "adaptive": False}
    )
    if model:
        snippet["model"] = model
    snippet["num_speculative_tokens"] = max(1, max(k for _, _, k in schedule))
    snippet["num_speculative_tokens_per_batch_size"] = schedule
    return snippet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "profile",
        help="JSON written by `vllm-peagle bench` (or a list of {concurrency, k, output_tok_s})",
    )
    parser.add_argument(
        "--method",
        default="peagle",
        help="which bench configuration's fixed-K rows to use (default peagle)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="which temperature's rows to use (default: the lowest measured)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1024,
        help="last batch size the table covers (vLLM's max_num_seqs)",
    )
    parser.add_argument("--drafter", default=None, help="drafter path to put in the snippet")
    parser.add_argument(
        "--engine",
        choices=["vllm", "peagle"],
        default="vllm",
        help="vllm: stock vLLM (eagle3 + parallel_drafting); peagle: ours",
    )
    parser.add_argument("-o", "--output", default=None, help="also write the snippet here")


def run(args: argparse.Namespace) -> int:
    try:
        measurements = load_profile(args.profile, args.method, args.temperature)
        best = best_k_per_concurrency(measurements)
        schedule = schedule_from_best_k(best, args.max_batch_size)
    except ProfileError as error:
        print(f"vllm-peagle tune: {error}", file=sys.stderr)
        return 2
    print("concurrency  best K  (0 = no speculation)")
    for concurrency, k in best.items():
        print(f"{concurrency:>11}  {k:>6}")
    snippet = json.dumps(speculative_config_snippet(schedule, args.drafter, args.engine))
    print(f"--speculative-config '{snippet}'")
    if args.output:
        Path(args.output).write_text(snippet + "\n")
    return 0
