"""A 2-layer random drafter small enough for exact CPU comparisons in unit tests."""

from __future__ import annotations

from vllm_peagle.modeling import PEagleDrafter, PEagleDrafterConfig


def small_drafter(vocab_size: int, mask_token_id: int | None) -> PEagleDrafter:
    """P-EAGLE with ``mask_token_id``, EAGLE-3 without; seed torch before calling."""
    cfg = PEagleDrafterConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=vocab_size,
        target_hidden_size=24,
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        mask_token_id=mask_token_id,
        rope_theta=100.0,
    )
    return PEagleDrafter(cfg)
