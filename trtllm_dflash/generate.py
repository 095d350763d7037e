"""Speculative generation: draft a block in one forward, verify it in one target forward, commit.

All per-request state lives in the generator's frame and the `GenerationStats` it fills, so many
requests can run side by side in one process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .config import SamplingParams
from .models.draft import DFlashDraftModel, DraftKVCache
from .models.target import TargetModel
from .sampling import rejection_sample, sample, sampling_probs


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    num_tokens: int = 0
    steps: int = 0  # target verify forwards after prefill
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps whose draft j+1 was accepted
    time_to_first_token: float = 0.0
    wall_time: float = 0.0
    finish_reason: str = ""

    @property
    def acceptance_length(self) -> float:
        """tau: committed tokens per target verify forward, bonus included (1.0 = autoregressive)."""
        decoded = self.num_tokens - 1  # the first token comes from the prefill
        return decoded / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "num_tokens": self.num_tokens,
            "steps": self.steps,
            "acceptance_length": round(self.acceptance_length, 4),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "time_to_first_token": round(self.time_to_first_token, 4),
            "wall_time": round(self.wall_time, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "finish_reason": self.finish_reason,
        }


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)


@torch.inference_mode()
def speculative_stream(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int,
    sampling: SamplingParams,
    stop_token_ids: frozenset[int],
    stats: GenerationStats,
    min_tokens: int = 0,
) -> Iterator[list[int]]:
    """Yield committed tokens as they are decided. block_size 1 (or no draft) is plain autoregressive decoding.

    min_tokens: stop tokens get probability 0 while fewer than that many tokens are generated (Hugging Face's
    min_new_tokens); the target's distribution is what changes, so verification stays exact.
    """
    t0 = time.perf_counter()
    B = block_size if draft is not None else 1
    gen = _generator(sampling.seed)
    n = len(prompt_ids)
    max_new_tokens = min(max_new_tokens, target.max_positions - n)
    stats.prompt_tokens, stats.accepted_per_position = n, [0] * (B - 1)

    stop_list = sorted(stop_token_ids)

    def hold_stops(logits: torch.Tensor, first: int) -> torch.Tensor:  # row j predicts generated token first + j
        rows = min_tokens - first
        if rows > 0 and stop_list:
            logits[:rows, stop_list] = float("-inf")
        return logits

    def commit(tokens: list[int]) -> list[int]:  # cut at the first stop token and at max_new_tokens
        out = []
        for t in tokens[: max_new_tokens - stats.num_tokens]:
            out.append(t)
            if t in stop_token_ids:
                stats.finish_reason = "stop"
                break
        stats.num_tokens += len(out)
        if not stats.finish_reason and stats.num_tokens >= max_new_tokens:
            stats.finish_reason = "length"
        stats.wall_time = time.perf_counter() - t0
        return out

    # Prefill: target cache holds positions [0, n); `token` (position n) is committed but not yet fed.
    cache = target.new_cache()
    logits, feats = target.forward(torch.tensor([prompt_ids]), 0, cache, capture=B > 1, logits_to_keep=1)
    last = hold_stops(logits[0, -1:], 0)  # [1, V]
    token = int(last.argmax(-1)[0] if sampling.greedy else sample(sampling_probs(last, sampling), gen)[0])
    stats.time_to_first_token = time.perf_counter() - t0
    yield commit([token])
    start = n  # position of `token`
    if B > 1:
        dcache = DraftKVCache.empty(draft.config, 1, n + max_new_tokens + B, target.dtype)
        mask_id = draft.config.mask_token_id
        ctx_feat = feats  # target features of positions [dcache.length, start) not yet in the draft cache

    while not stats.finish_reason:
        b = min(B, max_new_tokens - stats.num_tokens)  # never draft past the token budget
        drafts, q = torch.empty(0, dtype=torch.long), torch.empty(0, 0)
        if b > 1:
            # Draft: context K/V of the newly committed tokens (one GEMM, all layers), then one block forward.
            ctx_pos = torch.arange(dcache.length, start)[None]
            dcache.append(*draft.context_kv(draft.project_context(ctx_feat), ctx_pos))
            block = torch.tensor([[token] + [mask_id] * (b - 1)])
            hidden = draft(draft.embed_block(target.embed_tokens, block), torch.arange(start, start + b)[None],
                           dcache.k[:, :, :, :start], dcache.v[:, :, :, :start], draft.inference_masks(start, b))
            draft_logits = hold_stops(draft.compute_logits(hidden[0, 1:], target.lm_head), stats.num_tokens)  # slot j: position start+j
            if sampling.greedy:
                drafts = draft_logits.argmax(-1)
            else:
                q = sampling_probs(draft_logits, sampling)
                drafts = sample(q, gen)
        # Verify [token, d_1..d_{b-1}] at positions start..start+b-1 in one target forward.
        logits, feats = target.forward(torch.cat([torch.tensor([token]), drafts])[None], start, cache, capture=b > 1)
        hold_stops(logits[0], stats.num_tokens)
        if sampling.greedy:
            posterior = logits[0].argmax(-1)
            a = int((drafts == posterior[:-1]).int().cumprod(0).sum())
            bonus = int(posterior[a])
        else:
            a, bonus = rejection_sample(drafts, sampling_probs(logits[0], sampling), q, gen)
        stats.steps += 1
        stats.drafted_tokens += b - 1
        stats.accepted_tokens += a
        for j in range(a):
            stats.accepted_per_position[j] += 1
        new_tokens = commit(drafts[:a].tolist() + [bonus])
        start += a + 1
        target.crop(cache, start)  # drop the K/V of rejected drafts; the bonus is fed next step
        if b > 1:
            ctx_feat = feats[:, : a + 1]  # features of token + accepted drafts, positions old start..start-1
        token = bonus
        yield new_tokens
