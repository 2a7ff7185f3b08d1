"""torchrun training (gloo, two CPU processes) equals single-process training with the same
global batch, for DDP and for FSDP with sequence partitioning, and survives SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from vllm_peagle.training.trainer import CHECKPOINT_DIR, LOG_FILE, STATE_FILE, TrainConfig, Trainer

pytestmark = pytest.mark.slow

# Shared run settings: 4 sequences per step = 2 per rank; clipping is active (early grad
# norms are ~40 > 1), so the equivalence covers the global-norm clip too.
SETTINGS = dict(num_depths=3, batch_size=4, max_seq_len=64, lr=3e-3, warmup_steps=2)
# Relative tolerance on the logged loss of every step. Both runs do the same arithmetic on
# the same samples; the distributed one sums each rank's KL and averages two gradients
# instead of one sum, which reorders float32 additions (~1e-7 relative each) and Adam then
# carries such differences forward. Measured max deviation: ~6e-8 (DDP), ~4e-7 (FSDP with
# partitioning) over 12 steps; 1e-5 leaves margin yet catches any real mistake (a wrong
# shard, a missing gradient average, a misplaced sync: those give >1e-2 at step 1-3).
RTOL = 1e-5


@pytest.fixture(scope="module")
def data(local_models, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from vllm_peagle.training.data import stdlib_prompts

    tok = AutoTokenizer.from_pretrained(str(local_models.target))
    path = tmp_path_factory.mktemp("ddp-data") / "data.jsonl"
    texts = stdlib_prompts("held_in", 16, seed=11, min_chars=250)
    lines = [json.dumps({"input_ids": tok(t)["input_ids"][:64], "prompt_len": 4}) for t in texts]
    path.write_text("\n".join(lines) + "\n")
    return path


def single_process_losses(local_models, data: Path, out: Path, steps: int) -> list[float]:
    cfg = TrainConfig(
        target=str(local_models.target),
        data=str(data),
        out=str(out),
        steps=steps,
        checkpoint_every=steps,
        log_every=1,
        num_threads=1,
        export=False,
        **SETTINGS,
    )
    trainer = Trainer(cfg)
    trainer.run(progress=False)
    return [r["loss"] for r in trainer.history]


def torchrun(local_models, data: Path, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    """Two gloo ranks on the real CLI; the caller waits (or kills)."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        "-m", "vllm_peagle.cli", "train", "--target", str(local_models.target),
        "--data", str(data), "--out", str(out), "-k", str(SETTINGS["num_depths"]),
        "--steps", str(steps), "--batch-size", str(SETTINGS["batch_size"]),
        "--max-seq-len", str(SETTINGS["max_seq_len"]), "--lr", str(SETTINGS["lr"]),
        "--warmup-steps", str(SETTINGS["warmup_steps"]), "--log-every", "1",
        "--threads", "1", "--no-export", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 240) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        kill_tree(proc)
    assert rc == 0, out.with_suffix(".log").read_text()[-3000:]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker it started (by pid, nothing else)."""
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def logged(out: Path) -> list[dict]:
    path = out / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def deviation(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def test_ddp_loss_curve_equals_single_process(local_models, data, tmp_path) -> None:
    proc = torchrun(local_models, data, tmp_path / "ddp", 12, "--checkpoint-every", "12")
    reference = single_process_losses(local_models, data, tmp_path / "single", 12)
    finish(proc, tmp_path / "ddp")
    losses = [r["loss"] for r in logged(tmp_path / "ddp")]
    dev = deviation(reference, losses)
    print(f"DDP (2 gloo ranks) vs 1 process, 12 steps: max relative loss deviation {dev:.2e}")
    assert dev <= RTOL
    assert reference[-1] < 0.6 * reference[0]  # it trains, so the curves mean something


def test_fsdp_with_sequence_partition_equals_single_process(local_models, data, tmp_path) -> None:
    steps = 6
    proc = torchrun(
        local_models, data, tmp_path / "fsdp", steps, "--checkpoint-every", str(steps),
        "--distributed", "fsdp", "--segment-len", "16",
    )  # fmt: skip
    reference = single_process_losses(local_models, data, tmp_path / "single", steps)
    finish(proc, tmp_path / "fsdp")
    losses = [r["loss"] for r in logged(tmp_path / "fsdp")]
    dev = deviation(reference, losses)
    print(f"FSDP + 16-anchor segments vs 1 process, {steps} steps: max deviation {dev:.2e}")
    assert dev <= RTOL
    state = torch.load(tmp_path / "fsdp" / CHECKPOINT_DIR / STATE_FILE, weights_only=False)
    assert state["step"] == steps and "fc.weight" in state["model"]  # full, unsharded names


def test_sigkilled_torchrun_resumes_from_its_checkpoint(local_models, data, tmp_path) -> None:
    """DDP with partitioning, killed (SIGKILL to launcher and ranks) after its step-4
    checkpoint, restarted with the same command: it resumes from the checkpoint, redoes the
    lost steps bit for bit and finishes on the single-process curve."""
    steps, out = 12, tmp_path / "run"
    extra = ("--checkpoint-every", "4", "--segment-len", "16")
    # The reference runs first: run while torchrun trains, it let the whole run finish
    # before the first look at its log (CI, session 9).
    reference = single_process_losses(local_models, data, tmp_path / "single", steps)
    proc = torchrun(local_models, data, out, steps, *extra)
    deadline = time.monotonic() + 240
    try:
        while not any(r["step"] >= 6 for r in logged(out)):
            assert proc.poll() is None, out.with_suffix(".log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
    finally:
        kill_tree(proc)
    before = logged(out)
    killed_at = before[-1]["step"]
    assert killed_at < steps, "finished before the kill; nothing was interrupted"
    # Whatever was on disk at the kill is a complete checkpoint (written atomically).
    state = torch.load(out / CHECKPOINT_DIR / STATE_FILE, weights_only=False)
    assert state["step"] % 4 == 0 and 4 <= state["step"] <= killed_at

    proc = torchrun(local_models, data, out, steps, *extra)
    finish(proc, out)
    assert f"resumed from step {state['step']}" in out.with_suffix(".log").read_text()
    after = logged(out)[len(before) :]
    assert [r["step"] for r in after] == list(range(state["step"] + 1, steps + 1))
    # Steps computed both before the kill and after the resume agree exactly.
    redone = {r["step"]: r["loss"] for r in before if r["step"] > state["step"]}
    assert redone and all(redone[r["step"]] == r["loss"] for r in after if r["step"] in redone)
    curve = {r["step"]: r["loss"] for r in before[: state["step"]] + after}
    dev = deviation(reference, [curve[s] for s in range(1, steps + 1)])
    print(f"killed at step {killed_at}, resumed from {state['step']}: deviation {dev:.2e}")
    assert dev <= RTOL


def test_sharded_data_generation_equals_unsharded(local_models, tmp_path) -> None:
    """Two shards (hf backend, per-prompt seeds) are disjoint, cover every prompt, hold the
    records one unsharded run writes, and merge into exactly that set."""
    from vllm_peagle.training.data import generate_data, merge_shards, write_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl", [f"def f{i}(x):\n" for i in range(10)])
    common = dict(max_tokens=2, temperature=[0.0, 0.9], backend="hf", progress=False)
    generate_data(local_models.target, prompts, tmp_path / "all.jsonl", **common)
    shards = [tmp_path / f"shard-{i}.jsonl" for i in range(2)]
    for i, path in enumerate(shards):
        generate_data(local_models.target, prompts, path, num_shards=2, shard_index=i, **common)

    def records(path: Path) -> dict[str, dict]:
        return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}

    parts = [records(p) for p in shards]
    assert parts[0] and parts[1] and not parts[0].keys() & parts[1].keys()
    assert {**parts[0], **parts[1]} == records(tmp_path / "all.jsonl")
    assert merge_shards([*shards, shards[0]], tmp_path / "merged.jsonl") == 10  # dedups by id
    assert records(tmp_path / "merged.jsonl") == records(tmp_path / "all.jsonl")
    with pytest.raises(ValueError, match="shard index"):
        generate_data(local_models.target, prompts, shards[0], num_shards=2, shard_index=2)
