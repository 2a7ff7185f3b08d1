"""Single-pass P-EAGLE drafting inside vLLM.

``PEagleProposer`` replaces vLLM's ``EagleProposer`` in the model runner (see
:mod:`vllm_peagle.patches`). Engines not marked ``additional_config["vllm_peagle"]`` get the
stock behaviour untouched; marked engines draft all K tokens of every request in exactly one
drafter forward. vLLM's rejection sampler, scheduler and KV cache verify the drafts.

One decoding step, per request (K = 4, accepted context ``c1 c2``, sampled token ``t``)::

    drafter input    c2      t      <m>     <m>     <m>
    hidden input     h(c1)   h(c2)  h_mask  h_mask  h_mask
    position         p       p+1    p+2     p+3     p+4
    drafts                   d1     d2      d3      d4

``h(.)`` is the target's fused aux hidden state, ``<m>`` the mask token and ``h_mask`` the
learned shared hidden state (``fc(mask_hidden)``). Attention is causal over the drafter's
KV cache, so slot k sees the whole context and the slots before it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_peagle.config import ADDITIONAL_CONFIG_KEY

logger = logging.getLogger("vllm.vllm_peagle")


class PEagleProposer(EagleProposer):
    """vLLM's EAGLE proposer, with a single-pass drafting step for P-EAGLE engines."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner: Any = None):
        super().__init__(vllm_config, device, runner)
        settings = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        self.peagle_enabled = bool(settings) and self.parallel_drafting
        self.num_drafter_forwards = 0
        """Drafter forward passes run by :meth:`propose` (one per step for P-EAGLE)."""
        if self.peagle_enabled:
            logger.info(
                "vllm-peagle proposer active: K=%d drafted in one pass, mask token %d.",
                self.num_speculative_tokens,
                self.parallel_drafting_token_id,
            )

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [num_tokens]
        target_positions: torch.Tensor,  # [num_tokens]
        target_hidden_states: torch.Tensor,  # [num_tokens, num_aux * target_hidden]
        next_token_ids: torch.Tensor,  # [batch_size]
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,  # [batch_size]
        slot_mappings: Any = None,
    ) -> torch.Tensor:  # [batch_size, num_speculative_tokens]
        if not self.peagle_enabled:
            return super().propose(
                num_speculative_tokens,
                target_token_ids,
                target_positions,
                target_hidden_states,
                next_token_ids,
                token_indices_to_sample,
                common_attn_metadata,
                sampling_metadata,
                mm_embed_inputs=mm_embed_inputs,
                num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                slot_mappings=slot_mappings,
            )
        self._last_draft_probs = None
        if num_speculative_tokens == 0:
            # Adaptive K chose a plain decoding step: no drafter forward at all. The drafter's
            # KV cache misses these positions, which only lowers later acceptance (measured
            # by tests/test_adaptive_engine.py); verification keeps the output exact.
            return next_token_ids.new_empty((next_token_ids.shape[0], 0))
        # Slots are laid out for the configured K; a smaller per-step K (dynamic K) keeps
        # the leading drafts, which are exactly what a K-slot pass would produce for them.
        slots = self.extra_slots_per_request
        self.num_speculative_tokens = slots

        fused_hidden = self.model.combine_hidden_states(target_hidden_states)  # [T, H]
        num_tokens, sample_indices, attn_metadata = self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=fused_hidden,
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        _, per_layer_attn_metadata = self.build_per_group_and_layer_attn_metadata(attn_metadata)
        cudagraph_mode, num_input_tokens, num_tokens_across_dp = (
            self._determine_batch_execution_and_padding(num_tokens)
        )
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(
            num_tokens, num_input_tokens, mm_embed_inputs
        )
        with set_forward_context(
            per_layer_attn_metadata,
            self.vllm_config,
            num_tokens=num_input_tokens,
            num_tokens_across_dp=num_tokens_across_dp,
            cudagraph_runtime_mode=cudagraph_mode,
            slot_mapping=self._get_slot_mapping(slot_mapping_size, attn_metadata.slot_mapping),
        ):
            last_hidden_states, _ = self.model(**model_kwargs)
        self.num_drafter_forwards += 1

        # sample_indices: the sampled-token slot and the K-1 mask slots, request-major.
        draft_token_ids, draft_probs = self._sample_draft_tokens(
            last_hidden_states[sample_indices], sampling_metadata
        )
        draft_token_ids = draft_token_ids.view(-1, slots)[:, :num_speculative_tokens]
        if draft_probs is not None:
            vocab = draft_probs.shape[-1]
            self._last_draft_probs = draft_probs.view(-1, slots, vocab)[
                :, :num_speculative_tokens
            ].contiguous()
        return draft_token_ids
