"""generate-data inputs and outputs: prompt formats, corrupt lines, resume, feature cache."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from vllm_peagle.training.data import generate_data, read_dataset, read_prompts, stdlib_prompts
from vllm_peagle.training.hidden_states import FeatureCache, TargetModel, batch_features


@pytest.fixture(scope="module")
def tokenizer(local_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(local_models.target))


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_formats_and_corrupt_lines(tmp_path, tokenizer, caplog) -> None:
    path = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "def f(x):\n"}),
            "{not json",
            json.dumps({"messages": [{"role": "user", "content": "sort a list"}]}),
            json.dumps({"foo": 1}),
            "",
            json.dumps({"id": "mine", "prompt": "import os\n"}),
            json.dumps({"prompt": "def f(x):\n"}),  # a repeat keeps its own id
        ],
    )
    with caplog.at_level(logging.WARNING, logger="vllm_peagle.training"):
        prompts = read_prompts(path, tokenizer)
    assert f"{path}:2" in caplog.text and f"{path}:4" in caplog.text
    assert [p.where for p in prompts] == [f"{path}:{n}" for n in (1, 3, 6, 7)]
    assert prompts[1].text == "<s><|user|>\nsort a list</s>\n<|assistant|>\n"
    assert prompts[2].key == "mine"
    assert prompts[3].key == prompts[0].key + "#1"
    with pytest.raises(ValueError, match=rf"{path}:2"):
        read_prompts(path, tokenizer, on_error="raise")


@pytest.mark.slow
def test_generate_data_resumes_and_repairs_torn_tail(local_models, tmp_path) -> None:
    prompts = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"id": f"p{i}", "prompt": t})
            for i, t in enumerate(["def a(", "x = [", "if "])
        ],
    )
    out = tmp_path / "d.jsonl"
    kw = dict(max_tokens=4, temperature=[0.0, 0.7], backend="hf", batch_size=2, progress=False)
    assert generate_data(local_models.target, prompts, out, **kw) == 3
    first = out.read_text()
    assert generate_data(local_models.target, prompts, out, **kw) == 0  # nothing left to do
    records = [json.loads(line) for line in first.splitlines()]
    assert [r["temperature"] for r in records] == [0.0, 0.7, 0.0]
    assert all(len(r["response_token_ids"]) <= 4 for r in records)
    # A crash mid-append leaves a torn last line: it is cut off and regenerated.
    lines = first.splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])
    assert generate_data(local_models.target, prompts, out, **kw) == 1
    assert out.read_text() == first  # greedy prompt: the same tokens again
    samples = read_dataset(out)
    assert samples[0].input_ids == records[0]["prompt_token_ids"] + records[0]["response_token_ids"]
    assert samples[0].prompt_len == len(records[0]["prompt_token_ids"])


def test_stdlib_prompts_use_the_target_split() -> None:
    from vllm_peagle.tiny_models import BuildSettings, stdlib_split

    _, held_out = stdlib_split(BuildSettings())
    out_text = {f.read_text(encoding="utf-8", errors="replace") for f in held_out}
    snippets = stdlib_prompts("held_out", 5, seed=0)
    assert snippets == stdlib_prompts("held_out", 5, seed=0)
    assert all(any(s in text for text in out_text) for s in snippets)


def test_feature_cache_matches_on_the_fly(local_models, tmp_path) -> None:
    target = TargetModel(local_models.target, [1, 2, 3])
    seqs = [[0, 5, 6, 7, 8, 9], [0, 11, 12, 13]]
    ids, live = batch_features(target, seqs, pad_id=2)
    cache = FeatureCache(tmp_path / "cache", target)
    for _ in range(2):  # first fills the cache, second reads it
        ids2, cached = batch_features(target, seqs, pad_id=2, cache=cache)
        assert torch.equal(ids, ids2)
        for row, s in enumerate(seqs):
            n = len(s)
            torch.testing.assert_close(cached.aux[row, :n], live.aux[row, :n], atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(
                cached.logits[row, :n], live.logits[row, :n], atol=1e-4, rtol=0
            )
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 2
