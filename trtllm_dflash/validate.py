"""Check that a draft fits a target before anything runs (the same checks for generate, build and serve)."""

from __future__ import annotations

import math

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.errors import DFlashError


def validate_pair(
    draft: DraftConfig, *, hidden_size: int, num_layers: int, vocab_rows: int, rope_parameters: dict
) -> None:
    """Raise DFlashError with one sentence for the first mismatch; the target is described by plain facts."""
    if draft.hidden_size != hidden_size:
        raise DFlashError(
            f"The draft's hidden size {draft.hidden_size} differs from the target's {hidden_size}; "
            "a DFlash draft must be trained for this target (it shares its embedding and LM head)."
        )
    if draft.vocab_size != vocab_rows:
        raise DFlashError(
            f"The draft's vocab size {draft.vocab_size} differs from the target's {vocab_rows} embedding rows; use a draft trained for this target."
        )
    bad = [i for i in draft.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise DFlashError(
            f"The draft taps target layers {bad}, but the target has only layers 0..{num_layers - 1}; use a draft trained for this target."
        )
    if not 0 <= draft.mask_token_id < vocab_rows:
        raise DFlashError(
            f"The draft's mask_token_id {draft.mask_token_id} is not a row of the target's embedding (0..{vocab_rows - 1})."
        )
    t_theta = float(rope_parameters.get("rope_theta", 1e4))
    t_type = rope_parameters.get("rope_type", "default")
    d_type = draft.rope_parameters.get("rope_type", "default")
    if not math.isclose(draft.rope_theta, t_theta, rel_tol=1e-6) or d_type != t_type:
        raise DFlashError(
            f"The draft's RoPE ({d_type}, theta {draft.rope_theta:g}) differs from the target's ({t_type}, theta {t_theta:g}); "
            "positions would not line up, use a draft trained for this target."
        )
    if draft.block_size < 2:
        raise DFlashError(f"The draft's block_size is {draft.block_size}; a DFlash draft needs at least 2.")


def validate_block_size(block_size: int | None, draft: DraftConfig | None) -> int:
    """Resolve the block size: the draft's by default, never above it; 1 means autoregressive."""
    if block_size is None:
        return draft.block_size if draft is not None else 1
    if block_size < 1:
        raise DFlashError(f"--block-size must be at least 1, got {block_size}.")
    if draft is not None and block_size > draft.block_size:
        raise DFlashError(
            f"--block-size {block_size} exceeds the draft's trained block size {draft.block_size}; use at most {draft.block_size}."
        )
    return block_size
