"""A lightly trained drafter for the local tiny target in about a minute (no vLLM engine).

Meant for tests and demos that need a drafter whose acceptance is clearly above a random
one's (engine tests comparing offline and served acceptance, for example). The data are
held-in stdlib windows (the target's soft labels carry the signal) plus a few greedy
continuations of the target itself, since greedy decoding is what engine tests run.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch

from vllm_peagle.checkpoint import atomic_write_bytes
from vllm_peagle.training.trainer import CHECKPOINT_DIR, TrainConfig, Trainer


def _quick_data(target: Path, path: Path, seed: int, windows: int, greedy: int) -> Path:
    from transformers import AutoTokenizer

    from vllm_peagle.training.data import _HFGenerator, stdlib_prompts

    tok = AutoTokenizer.from_pretrained(str(target))
    texts = stdlib_prompts("held_in", windows + greedy, seed=seed, min_chars=300, max_chars=700)
    records = [{"input_ids": tok(t)["input_ids"][:160], "prompt_len": 0} for t in texts[:windows]]
    prompts = [tok(t)["input_ids"][:32] for t in texts[windows:]]
    responses = _HFGenerator(target)(prompts, [0] * len(prompts), 128, [0.0] * len(prompts))
    records += [
        {"input_ids": p + r, "prompt_len": len(p)} for p, r in zip(prompts, responses, strict=True)
    ]
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode())
    return path


def quick_train_drafter(
    target: str | os.PathLike | None = None,
    out_dir: str | os.PathLike | None = None,
    *,
    kind: Literal["peagle", "eagle3"] = "peagle",
    num_depths: int = 4,
    steps: int = 80,
    seed: int = 0,
    threads: int | None = 1,
    progress: bool = False,
) -> Path:
    """Train a small drafter for ``target`` (default: the local tiny target) in ~60-90 s.

    Returns the native-layout drafter directory ``out_dir/drafter`` (P-EAGLE runs also
    write ``out_dir/drafter-speculators``). A finished run in ``out_dir`` with the same
    settings is reused, so callers may invoke this on every start-up.
    """
    if target is None:
        from vllm_peagle.tiny_models import ensure_local_models

        target = ensure_local_models(progress=progress).target
    target = Path(target)
    out = Path(out_dir) if out_dir is not None else target.parent / f"quick-{kind}-k{num_depths}"
    cfg = TrainConfig(
        target=str(target),
        data=str(out / "quick_data.jsonl"),
        out=str(out),
        kind=kind,
        num_depths=num_depths,
        steps=steps,
        batch_size=4,
        max_seq_len=160,
        lr=3e-3,
        warmup_steps=8,
        seed=seed,
        checkpoint_every=steps,
        log_every=5,
        loss_on_prompt=True,
        num_threads=threads,
    )
    out.mkdir(parents=True, exist_ok=True)
    # One trainer per directory: concurrent test sessions wait and then reuse the result.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _finished(out, cfg):
            _train(cfg, target, seed, threads, progress)
    return out / "drafter"


def _finished(out: Path, cfg: TrainConfig) -> bool:
    summary = out / "train_summary.json"
    if not (summary.is_file() and (out / "drafter" / "config.json").is_file()):
        return False
    return json.loads(summary.read_text()).get("config") == json.loads(json.dumps(asdict(cfg)))


def _train(cfg: TrainConfig, target: Path, seed: int, threads: int | None, progress: bool) -> None:
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        data = Path(str(cfg.data))
        if not data.is_file():
            _quick_data(target, data, seed, windows=24, greedy=24)
        trainer = Trainer(cfg)
        try:
            trainer.load_checkpoint()  # an interrupted quick run continues
        except ValueError:  # written with other settings: start over
            shutil.rmtree(Path(cfg.out) / CHECKPOINT_DIR, ignore_errors=True)
            trainer = Trainer(cfg)
        trainer.run(progress=progress)
        if progress:
            print(f"quick-trained {cfg.kind} drafter in {time.perf_counter() - t0:.0f} s")
    finally:
        torch.set_num_threads(threads_before)
