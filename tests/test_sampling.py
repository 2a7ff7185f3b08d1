"""With temperature > 0, P-EAGLE output follows the same distribution as plain decoding."""

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2_contingency
from vllm import SamplingParams

from tests.engines import environment, peagle_spec, start_engine, stop_engine

pytestmark = pytest.mark.engine

SAMPLING_PROMPTS = ["def ", "import ", "class Foo:\n    "]
NUM_SAMPLES = 300
CONTINUATION = 3


def sample_continuations(llm) -> dict[str, list[tuple[int, ...]]]:
    requests, params = [], []
    for prompt in SAMPLING_PROMPTS:
        for seed in range(NUM_SAMPLES):
            requests.append(prompt)
            params.append(
                SamplingParams(temperature=1.0, max_tokens=CONTINUATION, seed=seed, ignore_eos=True)
            )
    outputs = llm.generate(requests, params, use_tqdm=False)
    samples: dict[str, list[tuple[int, ...]]] = {p: [] for p in SAMPLING_PROMPTS}
    for prompt, out in zip(requests, outputs, strict=True):
        samples[prompt].append(tuple(out.outputs[0].token_ids))
    return samples


def homogeneity_p_value(a: list, b: list) -> float:
    """Chi-square test that two samples come from one distribution (rare values pooled)."""
    ca, cb = Counter(a), Counter(b)
    common = [v for v in set(ca) | set(cb) if ca[v] + cb[v] >= 10]
    rare_a = sum(c for v, c in ca.items() if v not in common)
    rare_b = sum(c for v, c in cb.items() if v not in common)
    table = [[ca[v] for v in common] + [rare_a], [cb[v] for v in common] + [rare_b]]
    table = np.array(table)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table)[1])


@pytest.fixture(scope="module")
def samples(local_models, trained_peagle):
    with environment(VLLM_PLUGINS="no-plugins"):
        llm = start_engine(local_models.target)
        try:
            plain = sample_continuations(llm)
        finally:
            stop_engine(llm)
    spec = peagle_spec(trained_peagle, 4)
    llm = start_engine(local_models.target, spec)
    try:
        ours = sample_continuations(llm)
    finally:
        stop_engine(llm)
    return plain, ours


@pytest.mark.parametrize("position", range(CONTINUATION))
def test_token_distribution_matches_plain(samples, position):
    plain, ours = samples
    for prompt in SAMPLING_PROMPTS:
        a = [s[position] for s in plain[prompt]]
        b = [s[position] for s in ours[prompt]]
        # Nine comparisons in all: 1e-3 keeps the family-wise false alarm rate near 1%.
        assert homogeneity_p_value(a, b) > 1e-3, (prompt, position)


def test_samples_are_not_degenerate(samples):
    plain, ours = samples
    for prompt in SAMPLING_PROMPTS:
        assert len(set(ours[prompt])) > 10, "temperature 1.0 must give varied continuations"
        assert ours[prompt] != plain[prompt] or len(set(plain[prompt])) > 10
