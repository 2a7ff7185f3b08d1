"""Offline acceptance: vLLM's counting, greedy losslessness, unbiased rejection sampling."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_peagle.checkpoint import load_drafter
from vllm_peagle.evaluation.offline import (
    _Drafting,
    _verify,
    evaluate_offline,
    simulate_request,
)
from vllm_peagle.training.hidden_states import TargetModel

PROMPTS = ["import os\nimport sys\n\n\ndef main(", "class Queue:\n    def __init__(self"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(local_models) -> TargetModel:
    return TargetModel(local_models.target, [1, 2, 3])


def _greedy_reference(target: TargetModel, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(target.features(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def test_greedy_verification_prefix_and_bonus() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 1, 9]):
        logits[row, tok] = 5.0
    assert _verify(logits, [3, 7, 2], [None] * 3, 0.0, torch.Generator()) == (2, 1)
    assert _verify(logits, [3, 7, 1], [None] * 3, 0.0, torch.Generator()) == (3, 9)
    assert _verify(logits, [0, 7, 1], [None] * 3, 0.0, torch.Generator()) == (0, 3)


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_is_unbiased(one_hot: bool) -> None:
    # Whatever the draft distribution, the first emitted token must follow p.
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 5, 4000
    p_logits = torch.randn(2, vocab, generator=gen)
    p = torch.softmax(p_logits[0].double(), -1)
    q = torch.softmax(torch.randn(vocab, generator=gen).double() * 2, -1)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        if one_hot:
            draft, probs = int(q.argmax()), None
        else:
            draft, probs = int(torch.multinomial(q, 1, generator=gen)), q
        m, bonus = _verify(p_logits, [draft], [probs], 1.0, gen)
        counts[draft if m == 1 else bonus] += 1
    # 4000 trials: frequency std <= 0.008, so 0.03 is a ~4-sigma band.
    torch.testing.assert_close(counts / trials, p.float(), atol=0.03, rtol=0)


def test_greedy_offline_output_equals_plain_decoding(local_models, target) -> None:
    drafter = load_drafter(local_models.peagle_native)
    ids = target.model.config.bos_token_id
    prompt = [ids, 50, 60, 70, 80]
    ref = _greedy_reference(target, prompt, 20)
    for k in (1, 3, 6):
        res = evaluate_offline(target, drafter, [prompt], k, max_tokens=20, progress=False)
        assert res.outputs == [ref], k


class _Oracle(_Drafting):
    """Drafts the target's own greedy continuation (all accepted) or garbage (none)."""

    def __init__(self, target: TargetModel, k: int, right: bool) -> None:
        self.target, self.k, self.temperature, self.right = target, k, 0.0, right

    def reset(self) -> None:
        pass

    def __call__(self, tokens, aux, sampled, gen):
        greedy = _greedy_reference(self.target, [*tokens.tolist(), sampled], self.k)
        if not self.right:  # off by one token id: never the target's choice
            greedy = [(t + 1) % self.target.vocab_size for t in greedy]
        return greedy, [None] * self.k


@pytest.mark.parametrize("right", [True, False])
def test_counts_follow_vllm_definitions(target, right: bool) -> None:
    k, max_tokens = 3, 14
    counts = [0, 0, 0] + [0] * k
    prompt = [target.model.config.bos_token_id, 11, 12, 13]
    out = simulate_request(target, _Oracle(target, k, right), prompt, max_tokens, None, counts)
    drafts, draft_tokens, accepted, *per_pos = counts
    assert len(out) == max_tokens
    # Prefill yields 1 token and no draft; each step adds accepted + 1 bonus token.
    if right:
        assert drafts == 4 and accepted == 12 and per_pos == [4, 4, 4]  # 1 + 4 * 4 >= 14
    else:
        assert drafts == max_tokens - 1 and accepted == 0 and per_pos == [0, 0, 0]
    assert draft_tokens == k * drafts


def test_cached_drafting_equals_fresh_recompute(local_models, target) -> None:
    for drafter_dir in (local_models.peagle_native, local_models.eagle3):
        drafter = load_drafter(drafter_dir)
        k = 4
        cached = _Drafting(drafter, k, 0.0, "greedy")

        class Fresh(_Drafting):
            def __call__(self, tokens, aux, sampled, gen):
                self.reset()  # no KV reuse between steps: recompute the whole context
                return super().__call__(tokens, aux, sampled, gen)

        fresh = Fresh(drafter, k, 0.0, "greedy")
        prompt = [target.model.config.bos_token_id, 5, 6, 7, 8, 9]
        ca, cb = [0] * (3 + k), [0] * (3 + k)
        out_a = simulate_request(target, cached, prompt, 24, None, ca)
        out_b = simulate_request(target, fresh, prompt, 24, None, cb)
        assert out_a == out_b and ca == cb, drafter_dir.name


def test_sampled_mode_is_seeded(local_models, target) -> None:
    drafter = load_drafter(local_models.peagle_native)
    runs = [
        evaluate_offline(
            target, drafter, PROMPTS, 4, max_tokens=16, temperature=0.7, seed=3, progress=False
        )
        for _ in range(2)
    ]
    assert runs[0].outputs == runs[1].outputs
    assert runs[0].counters == runs[1].counters
    res = runs[0]
    assert res.acceptance_length == pytest.approx(1 + sum(res.per_position_acceptance))
    acc = res.per_position_acceptance
    assert all(a >= b for a, b in itertools.pairwise(acc))
