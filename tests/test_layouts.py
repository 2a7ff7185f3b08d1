"""Both published checkpoint layouts serve losslessly; P-EAGLE is recognised without a method."""

import pytest

from tests.engines import (
    BATCH_SIZES,
    PROMPTS,
    drafter_info,
    greedy_token_ids,
    start_engine,
    stop_engine,
)

pytestmark = pytest.mark.engine


def test_speculators_layout_recognised_without_method(local_models, plain_reference):
    # Stock vLLM 0.32 takes this for a draft_model and dies at its first step.
    spec = {"model": str(local_models.peagle_speculators), "num_speculative_tokens": 4}
    llm = start_engine(local_models.target, spec)
    try:
        assert drafter_info(llm)[0]["peagle_enabled"] is True
        for batch_size in BATCH_SIZES:
            assert greedy_token_ids(llm, PROMPTS[:batch_size]) == plain_reference[batch_size]
    finally:
        stop_engine(llm)
