"""Offline acceptance bucketed by context length (small edges: the tiny target stops at 512)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_peagle.evaluation.long_context import ContextBuckets, StepRecord, bucket_counters
from vllm_peagle.evaluation.offline import evaluate_offline
from vllm_peagle.training.hidden_states import TargetModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bucket_edges() -> None:
    b = ContextBuckets((32, 64))
    assert b.labels == ["[0, 32)", "[32, 64)", "[64, inf)"]
    assert [b.index(n) for n in (0, 31, 32, 63, 64, 10_000)] == [0, 0, 1, 1, 2, 2]
    assert ContextBuckets().labels == ["[0, 2048)", "[2048, 8192)", "[8192, inf)"]
    for bad in ((), (64, 32), (32, 32), (0, 8)):
        with pytest.raises(ValueError, match="strictly increasing"):
            ContextBuckets(bad)


def test_bucket_counters_by_hand() -> None:
    steps = [StepRecord(10, 2), StepRecord(31, 0), StepRecord(32, 3), StepRecord(90, 1)]
    got = bucket_counters(steps, 3, ContextBuckets((32, 64)))
    short, mid, long = got.values()
    assert (short.num_drafts, short.num_draft_tokens, short.num_accepted_tokens) == (2, 6, 2)
    assert short.accepted_per_position == (1, 1, 0)
    assert mid.accepted_per_position == (1, 1, 1) and mid.acceptance_length == 4.0
    assert (long.num_drafts, long.num_accepted_tokens) == (1, 1)


@pytest.fixture(scope="module")
def target(local_models) -> TargetModel:
    return TargetModel(local_models.target, [1, 2, 3])


def prompt_ids(local_models, n: int, seed: int) -> list[int]:
    from transformers import AutoTokenizer

    from vllm_peagle.training.data import stdlib_prompts

    tok = AutoTokenizer.from_pretrained(str(local_models.target))
    text = "".join(stdlib_prompts("held_out", 4, seed=seed, min_chars=400))
    ids = tok(text)["input_ids"][:n]
    assert len(ids) == n
    return ids


def test_steps_land_in_the_bucket_of_their_context(local_models, target) -> None:
    """Prompts of 8, 40 and 80 tokens, 16 new tokens each, edges 32/64: the 8-token prompt
    never reaches 32 tokens, the 40-token one stays in [32, 64) (40 + 16 < 64), the 80-token
    one starts past 64; per-bucket counters add up to the overall ones."""
    k = 3
    prompts = [prompt_ids(local_models, n, s) for n, s in ((8, 1), (40, 2), (80, 3))]
    buckets = ContextBuckets((32, 64))
    whole = evaluate_offline(
        target, local_models.peagle_native, prompts, k, max_tokens=16, progress=False,
        context_buckets=buckets,
    )  # fmt: skip
    short, mid, long = whole.by_context.values()
    total = whole.counters
    assert short.num_drafts + mid.num_drafts + long.num_drafts == total.num_drafts
    assert sum(c.num_accepted_tokens for c in whole.by_context.values()) == (
        total.num_accepted_tokens
    )
    for i in range(k):
        assert (
            sum(c.accepted_per_position[i] for c in whole.by_context.values())
            == (total.accepted_per_position[i])
        )
    # Each prompt alone: all its steps in one bucket, with the same counters as there.
    for prompt, bucket in zip(prompts, (short, mid, long), strict=True):
        alone = evaluate_offline(
            target, local_models.peagle_native, [prompt], k, max_tokens=16, progress=False,
            context_buckets=buckets,
        )  # fmt: skip
        assert [c.num_drafts > 0 for c in alone.by_context.values()].count(True) == 1
        assert bucket == alone.counters
    report = whole.to_dict()["by_context_length"]
    assert list(report) == buckets.labels
    assert report["[64, inf)"]["num_drafts"] == long.num_drafts


@pytest.mark.slow
def test_eval_cli_reports_buckets(local_models, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\nimport sys\n\n\ndef main("}) + "\n")
    out = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable, "-m", "vllm_peagle.cli", "eval", "--target", str(local_models.target),
            "--drafter", str(local_models.peagle_native), "-k", "2", "--prompts", str(prompts),
            "--max-tokens", "12", "--threads", "1", "--context-buckets", "16", "24",
            "--json", str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    buckets = report["by_context_length"]
    assert list(buckets) == ["[0, 16)", "[16, 24)", "[24, inf)"]
    assert sum(b["num_drafts"] for b in buckets.values()) == report["num_drafts"] > 0
