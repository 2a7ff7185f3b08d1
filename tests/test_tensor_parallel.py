"""Everything we serve holds under tensor parallelism (two CPU workers)."""

import pytest

from tests.engines import (
    PROMPTS,
    drafter_info,
    environment,
    greedy_token_ids,
    install_forward_counters,
    peagle_spec,
    read_forward_counters,
    start_engine,
    stop_engine,
)

pytestmark = pytest.mark.engine

TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def tp2_plain(local_models) -> dict[int, list[list[int]]]:
    with environment(VLLM_PLUGINS="no-plugins", **TP2):
        llm = start_engine(local_models.target, tensor_parallel_size=2)
        try:
            return {b: greedy_token_ids(llm, PROMPTS[:b]) for b in (4, 16)}
        finally:
            stop_engine(llm)


def test_tp2_lossless_with_one_drafter_pass(local_models, trained_peagle, tp2_plain):
    spec = peagle_spec(trained_peagle, 4)
    with environment(**TP2):
        llm = start_engine(local_models.target, spec, tensor_parallel_size=2)
        try:
            assert [i["peagle_enabled"] for i in drafter_info(llm)] == [True, True]
            install_forward_counters(llm)
            for batch_size in (4, 16):
                assert greedy_token_ids(llm, PROMPTS[:batch_size]) == tp2_plain[batch_size]
            for counts in read_forward_counters(llm):
                assert counts["drafter"] == counts["target"] > 0
        finally:
            stop_engine(llm)


def test_tp2_lossless_with_adaptive_k(local_models, trained_peagle, tp2_plain):
    spec = peagle_spec(trained_peagle, 4, adaptive=True)
    with environment(**TP2):
        llm = start_engine(local_models.target, spec, tensor_parallel_size=2)
        try:
            install_forward_counters(llm)
            for batch_size in (4, 16):
                assert greedy_token_ids(llm, PROMPTS[:batch_size]) == tp2_plain[batch_size]
            first, second = read_forward_counters(llm)
            # Both workers skip the drafter on the same K = 0 steps (start-up calibration
            # has some), and draft together on all others.
            assert (first["target"], first["drafter"]) == (second["target"], second["drafter"])
            assert 0 < first["drafter"] < first["target"]
        finally:
            stop_engine(llm)
