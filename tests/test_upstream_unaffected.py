"""With the plugin installed, every other speculative method behaves exactly as without it."""

import pytest

from tests.engines import (
    PROMPTS,
    drafter_info,
    environment,
    greedy_token_ids,
    spec_decode_counters,
    start_engine,
    stop_engine,
)

pytestmark = pytest.mark.engine


def run(target, spec, plugin: bool) -> tuple[list[list[int]], dict, list[dict]]:
    env = {} if plugin else {"VLLM_PLUGINS": "no-plugins"}
    with environment(**env):
        llm = start_engine(target, spec)
        try:
            tokens = greedy_token_ids(llm, PROMPTS[:4])
            return tokens, spec_decode_counters(llm), drafter_info(llm)
        finally:
            stop_engine(llm)


def test_upstream_parallel_drafting_untouched_and_equal_to_ours(local_models, plain_reference):
    upstream = {
        "method": "eagle3",
        "parallel_drafting": True,
        "model": str(local_models.peagle_native),
        "num_speculative_tokens": 4,
    }
    ours = {
        "method": "peagle",
        "model": str(local_models.peagle_native),
        "num_speculative_tokens": 4,
        "adaptive": False,  # counters are compared with upstream's fixed K
    }
    tokens_off, counters_off, info_off = run(local_models.target, upstream, plugin=False)
    tokens_on, counters_on, info_on = run(local_models.target, upstream, plugin=True)
    tokens_ours, counters_ours, _ = run(local_models.target, ours, plugin=True)

    assert info_off[0]["class"] == "EagleProposer"
    assert info_on[0] == {
        "class": "PEagleProposer",
        "peagle_enabled": False,
        "parallel_drafting": True,
    }
    assert tokens_off == tokens_on == tokens_ours == plain_reference[4]
    # Same checkpoint, same K: our single pass drafts exactly what upstream drafts.
    assert counters_off == counters_on == counters_ours


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_other_methods_equal_plain_decoding(method, local_models, plain_reference):
    if method == "eagle3":
        spec = {"method": "eagle3", "model": str(local_models.eagle3), "num_speculative_tokens": 3}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    tokens, counters, info = run(local_models.target, spec, plugin=True)
    assert tokens == plain_reference[4]
    assert counters.num_drafts > 0
    assert info[0].get("peagle_enabled") in (False, None)
