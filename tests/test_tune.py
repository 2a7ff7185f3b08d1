"""`vllm-peagle tune`: a K-per-batch-size table from a measured profile, valid for vLLM."""

import itertools
import json

import pytest
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

from tests.engines import PROMPTS, environment, greedy_token_ids, start_engine, stop_engine
from vllm_peagle.adaptive.tune import (
    ProfileError,
    best_k_per_concurrency,
    load_profile,
    measurements_from_bench,
    schedule_from_best_k,
    speculative_config_snippet,
)
from vllm_peagle.cli import main

PROFILE = [
    # concurrency, K, tok/s: K=7 wins alone, K=4 in the middle, no speculation under load
    *[(1, k, t) for k, t in ((0, 100.0), (4, 180.0), (7, 210.0))],
    *[(4, k, t) for k, t in ((0, 350.0), (4, 420.0), (7, 400.0))],
    *[(16, k, t) for k, t in ((0, 900.0), (4, 910.0), (7, 850.0))],
    *[(64, k, t) for k, t in ((0, 2000.0), (4, 1500.0), (7, 1200.0))],
]


def test_best_k_per_concurrency():
    assert best_k_per_concurrency(PROFILE) == {1: 7, 4: 4, 16: 4, 64: 0}
    # repeats average; ties go to the smaller K
    assert best_k_per_concurrency([(1, 4, 10.0), (1, 4, 30.0), (1, 2, 20.0)]) == {1: 2}


def test_schedule_gives_vllm_the_best_k_at_each_measured_concurrency():
    best = best_k_per_concurrency(PROFILE)
    schedule = schedule_from_best_k(best, max_batch_size=256)
    assert schedule[0][0] == 1 and schedule[-1][1] == 256
    assert all(a[2] != b[2] for a, b in itertools.pairwise(schedule)), "merged"
    # vLLM's own parser and expander accept it and give each measured concurrency its best K.
    lookup = build_dynamic_sd_schedule_lookup(schedule, 256, max(best.values()))
    assert {c: lookup[c] for c in best} == best


def test_bench_json_is_a_profile(tmp_path):
    doc = {
        "summary": [
            {
                "k": 4,
                "temperature": 0.0,
                "concurrency": 1,
                "configs": {"none": {"output_tok_s": 100.0}, "peagle": {"output_tok_s": 150.0}},
            },
            {
                "k": 7,
                "temperature": 0.0,
                "concurrency": 1,
                "configs": {"none": {"output_tok_s": 101.0}, "peagle": {"output_tok_s": 140.0}},
            },
            {
                "k": 4,
                "temperature": 0.7,
                "concurrency": 1,
                "configs": {"none": {"output_tok_s": 99.0}, "peagle": {"output_tok_s": 90.0}},
            },
        ]
    }
    greedy = measurements_from_bench(doc)
    assert sorted(greedy) == [(1, 0, 100.0), (1, 0, 101.0), (1, 4, 150.0), (1, 7, 140.0)]
    assert best_k_per_concurrency(measurements_from_bench(doc, temperature=0.7)) == {1: 0}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    assert load_profile(path) == greedy


def test_cli_prints_a_pasteable_config(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps([{"concurrency": c, "k": k, "output_tok_s": t} for c, k, t in PROFILE])
    )
    out = tmp_path / "snippet.json"
    assert (
        main(["tune", str(profile), "--drafter", "D", "-o", str(out), "--max-batch-size", "128"])
        == 0
    )
    printed = capsys.readouterr().out
    snippet = json.loads(out.read_text())
    assert f"--speculative-config '{json.dumps(snippet)}'" in printed
    assert snippet["method"] == "eagle3" and snippet["parallel_drafting"] is True
    assert snippet["model"] == "D" and snippet["num_speculative_tokens"] == 7
    assert snippet["num_speculative_tokens_per_batch_size"][-1] == [
        snippet["num_speculative_tokens_per_batch_size"][-1][0],
        128,
        0,
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{not json", "is not JSON"),
        ('[{"k": 1}]', "needs concurrency, k and output_tok_s"),
        ('{"runs": []}', "has no 'summary' list"),
        ('{"summary": []}', "has no 'peagle' or 'none' rows"),
    ],
)
def test_bad_profiles_are_one_line_errors(tmp_path, capsys, content, message):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        best_k_per_concurrency(load_profile(path))
    assert main(["tune", str(path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.engine
def test_stock_vllm_serves_the_tuned_table_losslessly(local_models, plain_reference):
    schedule = schedule_from_best_k({1: 4, 4: 0, 16: 2}, max_batch_size=32)
    spec = speculative_config_snippet(schedule, str(local_models.peagle_native), engine="vllm")
    with environment(VLLM_PLUGINS="no-plugins"):  # stock vLLM, as a user pasting it runs it
        llm = start_engine(local_models.target, spec)
        try:
            for batch_size in (1, 4, 16):
                assert greedy_token_ids(llm, PROMPTS[:batch_size]) == plain_reference[batch_size]
        finally:
            stop_engine(llm)
