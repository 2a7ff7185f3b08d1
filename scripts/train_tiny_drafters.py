#!/usr/bin/env python3
"""Train a P-EAGLE and an EAGLE-3 drafter for the local tiny target and measure both.

    python scripts/train_tiny_drafters.py            # ~25-30 min on 2 shared CPU cores

Pipeline (each stage resumes if its output exists):

1. prompts: held-in stdlib snippets for training, held-out ones for evaluation
   (the tiny target's own train/test split of the standard library);
2. data: the target regenerates a response per prompt with vLLM (half greedy, half
   sampled at T=0.7: greedy decoding of the tiny target loops, sampling does not);
3. train P-EAGLE (K=7, COD r=0.7/0.2, one pass) and EAGLE-3 (7 TTT steps), same data,
   steps and time cap;
4. offline acceptance at K=7, greedy and T=0.7 (rejection sampling with draft probs;
   also argmax drafts, vLLM's default), written to ``OUT/report.json`` and ``OUT/REPORT.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None, help="default: <model build>/runs/tiny-drafters")
    ap.add_argument("--train-prompts", type=int, default=1024)
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--response-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=300, help="training steps per drafter")
    ap.add_argument("--minutes-per-drafter", type=float, default=10.0, help="wall-clock cap")
    ap.add_argument("-k", type=int, default=7)
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a busy box)")
    args = ap.parse_args()

    import torch

    from vllm_peagle.evaluation.offline import evaluate_offline
    from vllm_peagle.tiny_models import ensure_local_models
    from vllm_peagle.training.data import generate_data, stdlib_prompts, write_prompts
    from vllm_peagle.training.export import summarize_history
    from vllm_peagle.training.trainer import TrainConfig, Trainer

    t_start = time.perf_counter()
    models = ensure_local_models()
    # Keyed by the model build: results of another target must never be resumed.
    out = Path(args.out) if args.out else models.root / "runs" / "tiny-drafters"
    out.mkdir(parents=True, exist_ok=True)
    target = str(models.target)
    timings: dict[str, float] = {}

    train_prompts, eval_prompts = out / "prompts_train.jsonl", out / "prompts_eval.jsonl"
    if not train_prompts.exists():
        write_prompts(train_prompts, stdlib_prompts("held_in", args.train_prompts, seed=1))
    if not eval_prompts.exists():
        write_prompts(eval_prompts, stdlib_prompts("held_out", args.eval_prompts, seed=0))

    t0 = time.perf_counter()
    data = out / "data.jsonl"
    generate_data(
        target,
        train_prompts,
        data,
        max_tokens=args.response_tokens,
        temperature=[0.0, 0.7],
        batch_size=128,
    )
    timings["generate_data_s"] = round(time.perf_counter() - t0, 1)

    torch.set_num_threads(args.threads)
    drafters: dict[str, Path] = {}
    training: dict[str, dict] = {}
    for kind in ("peagle", "eagle3"):
        cfg = TrainConfig(
            target=target,
            data=str(data),
            out=str(out / kind),
            kind=kind,
            num_depths=args.k,
            steps=args.steps,
            batch_size=4,
            max_seq_len=320,
            lr=2e-3,
            warmup_steps=30,
            checkpoint_every=50,
            num_threads=args.threads,
        )
        trainer = Trainer(cfg)
        if trainer.load_checkpoint():
            print(f"{kind}: resumed at step {trainer.step}")
        result = trainer.run(time_budget_s=args.minutes_per_drafter * 60)
        if not result.exported:  # finished earlier: export is idempotent
            result.exported = trainer.export()
        drafters[kind] = Path(result.exported["native"])
        training[kind] = {
            "steps": result.steps,
            "train_seconds": round(result.seconds, 1),
            **summarize_history(result.history),
        }

    t0 = time.perf_counter()
    from transformers import AutoTokenizer

    from vllm_peagle.training.data import read_prompts

    tok = AutoTokenizer.from_pretrained(target)
    prompts = [p.text for p in read_prompts(eval_prompts, tok)]
    evals: dict[str, dict] = {}
    # T=0.7 twice: drafts sampled from the drafter (rejection sampling with draft probs,
    # the honest sampled figure) and argmax drafts with one-hot q (vLLM's default).
    settings = [(0.0, "probabilistic"), (0.7, "probabilistic"), (0.7, "greedy")]
    for kind, path in drafters.items():
        for temperature, sampling in settings:
            res = evaluate_offline(
                target,
                path,
                prompts,
                args.k,
                max_tokens=args.eval_tokens,
                temperature=temperature,
                draft_sampling=sampling,  # type: ignore[arg-type]
            )
            name = f"{kind}@T={temperature}" + (
                "/argmax-drafts" if temperature and sampling == "greedy" else ""
            )
            evals[name] = res.to_dict()
    timings["eval_s"] = round(time.perf_counter() - t0, 1)
    timings["total_s"] = round(time.perf_counter() - t_start, 1)

    report = {"k": args.k, "training": training, "eval": evals, "timings": timings}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Tiny-target drafters, K={args.k} (held-out stdlib prompts x {len(prompts)}, "
        f"{args.eval_tokens} tokens)",
        "",
        "| drafter | T | AL | per-position acceptance |",
        "|---|---|---|---|",
    ]
    for name, r in evals.items():
        kind, temp = name.split("@T=", 1)
        lines.append(
            f"| {kind} | {temp} | {r['acceptance_length']:.2f} | "
            f"{_fmt(r['per_position_acceptance'])} |"
        )
    lines += [
        "",
        "| drafter | steps | train s | loss first→last | acc/depth last |",
        "|---|---|---|---|---|",
    ]
    for kind, t in training.items():
        lines.append(
            f"| {kind} | {t['steps']} | {t['train_seconds']} | {t['first_loss']}→{t['last_loss']} "
            f"| {_fmt([a or 0.0 for a in t['last_acc']])} |"
        )
    lines += ["", f"timings: {json.dumps(timings)}"]
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"report: {out / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
