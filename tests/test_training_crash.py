"""Crash safety of training: SIGKILL while a checkpoint is written, then resume; corrupt data.

The kills are real SIGKILLs of a child process (no clean-up code runs), injected at every
file-system step of a checkpoint write in turn.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_peagle.checkpoint import atomic_directory
from vllm_peagle.training.data import read_dataset


def _write_version(path: Path, version: int, kill_at: int) -> None:
    """In a forked child: write checkpoint ``version``, SIGKILLing ourselves at call ``kill_at``."""
    import vllm_peagle.checkpoint as checkpoint

    calls = 0

    def step(real):
        def wrapped(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return wrapped

    os.replace, os.fsync = step(os.replace), step(os.fsync)
    if hasattr(checkpoint, "_exchange"):
        checkpoint._exchange = step(checkpoint._exchange)
    write = step(lambda file, data: file.write_bytes(data))
    with atomic_directory(path) as stage:
        write(stage / "state.bin", bytes([version]) * 50_000)
        write(stage / "meta.json", json.dumps({"version": version}).encode())


def _read_version(path: Path) -> int:
    meta = json.loads((path / "meta.json").read_text())["version"]
    assert (path / "state.bin").read_bytes() == bytes([meta]) * 50_000, "torn checkpoint"
    return meta


def _wait(pid: int, timeout_s: float) -> int:
    """waitpid with a deadline: a child stuck after fork fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"checkpoint-writing child {pid} hung")


def test_sigkill_at_every_step_of_a_checkpoint_write_keeps_a_whole_one(tmp_path):
    path = tmp_path / "checkpoint"
    kills = 0
    for kill_at in range(1, 50):
        with atomic_directory(path) as stage:  # the previous checkpoint
            (stage / "state.bin").write_bytes(bytes([1]) * 50_000)
            (stage / "meta.json").write_text(json.dumps({"version": 1}))
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                _write_version(path, 2, kill_at)
            finally:
                os._exit(0)
        status = _wait(pid, timeout_s=60)
        assert path.is_dir(), f"killed at step {kill_at}: no checkpoint left at all"
        version = _read_version(path)
        if os.WIFSIGNALED(status):
            assert os.WTERMSIG(status) == signal.SIGKILL
            kills += 1
            continue
        assert version == 2, "a finished write must leave the new checkpoint"
        break
    else:
        pytest.fail("the write never finished")
    assert kills >= 5, f"only {kills} kill points were exercised"
    print(f"checkpoint write: survived SIGKILL at each of {kills} steps")


def _data(local_models, path: Path, corrupt: bool) -> Path:
    from transformers import AutoTokenizer

    from vllm_peagle.training.data import stdlib_prompts

    tok = AutoTokenizer.from_pretrained(str(local_models.target))
    good = [
        json.dumps({"input_ids": tok(t)["input_ids"][:48], "prompt_len": 2})
        for t in stdlib_prompts("held_in", 8, seed=5, min_chars=200)
    ]
    lines = [line.encode() for line in good]
    if corrupt:
        lines[2:2] = [b'{"input_ids": [1, 2', b'{"input_ids": "\xff\xfe", "prompt_len": 0}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


CHILD = """
import json, os, signal, sys, torch
from vllm_peagle.training.trainer import TrainConfig, Trainer
cfg, kill_step = TrainConfig(**json.loads(sys.argv[1])), int(sys.argv[2])
trainer = Trainer(cfg)
trainer.load_checkpoint()
real_save = torch.save
def dying_save(obj, file, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("step") == kill_step:
        with open(file, "wb") as fh:  # half a checkpoint on disk, then the kill
            fh.write(b"partial" * 10000)
            fh.flush()
            os.fsync(fh.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, file, *args, **kwargs)
torch.save = dying_save
trainer.run(progress=False)
"""


@pytest.mark.slow
def test_trainer_killed_while_checkpointing_resumes_from_the_previous_one(
    local_models, tmp_path, caplog
):
    from vllm_peagle.training.trainer import CHECKPOINT_DIR, TrainConfig, Trainer

    data = _data(local_models, tmp_path / "data.jsonl", corrupt=True)
    settings = dict(
        target=str(local_models.target),
        data=str(data),
        out=str(tmp_path / "run"),
        num_depths=2,
        steps=4,
        batch_size=2,
        max_seq_len=48,
        checkpoint_every=1,
        log_every=1,
        num_threads=1,
        export=False,
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(settings), "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    state = torch.load(tmp_path / "run" / CHECKPOINT_DIR / "state.pt", weights_only=False)
    assert state["step"] == 2, "the step-2 checkpoint must survive the kill during step 3's"

    with caplog.at_level(logging.WARNING, logger="vllm_peagle.training"):
        resumed = Trainer(TrainConfig(**settings))
    assert f"{data}:3: invalid JSON" in caplog.text
    assert f"{data}:4: not UTF-8" in caplog.text
    assert len(resumed.samples) == 8
    assert resumed.load_checkpoint() and resumed.step == 2
    for name, tensor in resumed.drafter.state_dict().items():
        assert torch.equal(tensor, state["model"][name]), name
    resumed.run(progress=False)
    assert resumed.step == 4
    assert [r["step"] for r in resumed.history] == [1, 2, 3, 4]


BAD_LINES = {
    "invalid-json": (b'{"input_ids": [1, 2', "invalid JSON"),
    "invalid-utf8": (b'{"input_ids": [1, 2, 3], "note": "\xff"}', "not UTF-8"),
    "not-an-object": (b"[1, 2, 3]", "not a data record"),
    "no-token-ids": (b'{"text": "hello"}', "not a data record"),
    "string-ids": (b'{"input_ids": ["a", "b", "c"]}', "not a data record"),
    "fractional-ids": (b'{"input_ids": [1.5, 2, 3]}', "not a data record"),
    "negative-ids": (b'{"input_ids": [1, -2, 3]}', "not a data record"),
    "bool-ids": (b'{"input_ids": [true, 2, 3]}', "not a data record"),
    "bad-prompt-len": (b'{"input_ids": [1, 2, 3], "prompt_len": "x"}', "not a data record"),
}
GOOD = b'{"prompt_token_ids": [5, 6], "response_token_ids": [7, 8, 9]}'


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_corrupt_data_lines_are_skipped_or_rejected_with_file_and_line(case, tmp_path, caplog):
    line, message = BAD_LINES[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([GOOD, line, GOOD]) + b"\n")
    with caplog.at_level(logging.WARNING, logger="vllm_peagle.training"):
        samples = read_dataset(path)
    assert [s.input_ids for s in samples] == [[5, 6, 7, 8, 9]] * 2
    assert f"{path}:2: {message}" in caplog.text, caplog.text
    with pytest.raises(ValueError, match=f"{path}:2: {message}") as info:
        read_dataset(path, on_error="raise")
    print(f"{case}: {info.value}")
