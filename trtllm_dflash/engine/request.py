"""A request as the engine holds it: its inputs, its place in the sequence, what it has committed, and its statistics.

`Request.commit` is the one place committed tokens are cut at a stop token and at the budget; `GenerationStats` is
what a client sees of the request (its per-step part comes from the step's record, step.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.lookup import NgramIndex
from trtllm_dflash.models.draft_ngram import RequestCounts


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (prefix_cache.py)
    num_tokens: int = 0
    steps: int = 0  # target verify forwards after prefill
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_counts_estimated: bool = False  # drafted/accepted inferred from iteration counts, not counted by the engine
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps whose draft j+1 was accepted
    lookup_steps: int = 0  # steps that verified lookup guesses instead of the draft's (lookup.py)
    lookup_accepted: int = 0  # ... and the guesses of theirs accepted
    block_lengths: dict[int, int] = field(default_factory=dict)  # block length the policy chose -> steps
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

    def add_step(self, k: int, accepted: int, looked: bool) -> None:
        """One verify forward of this request: a block of `k` tokens (k - 1 guesses), `accepted` of them taken;
        `looked`: the guesses were prompt lookup's, not the draft's."""
        self.steps += 1
        self.drafted_tokens += k - 1
        self.accepted_tokens += accepted
        self.block_lengths[k] = self.block_lengths.get(k, 0) + 1
        if looked:
            self.lookup_steps += 1
            self.lookup_accepted += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "num_tokens": self.num_tokens,
            "steps": self.steps,
            "acceptance_length": round(self.acceptance_length, 4),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "lookup_steps": self.lookup_steps,
            "lookup_accepted": self.lookup_accepted,
            "block_lengths": {str(k): v for k, v in sorted(self.block_lengths.items())},
            "time_to_first_token": round(self.time_to_first_token, 4),
            "wall_time": round(self.wall_time, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "finish_reason": self.finish_reason,
        }


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)


# PendingFeatures: parts a request's log holds before they are joined into one tensor, which bounds the forwards' outputs
# that one request keeps alive while it decodes plainly
MAX_PARTS = 64


class PendingFeatures:
    """The target's features (n_sel*H per token) of a request's committed positions that its draft context has not
    taken in yet: for a row decoding plainly, every step's. Each step adds its row of the verify forward's output
    where it lies, with no copy: copied into a per-slot buffer, a step's rows each landed in memory the forward had
    just evicted, and those scattered writes made a plain step of the DFlash build measurably dearer than the build
    without a draft's (docs/performance.md#plain-steps). They are joined once, when the row drafts.

    Invariant: `tokens` rows in position order, from the first position the row's draft context lacks up to its
    `start`; at most MAX_PARTS parts."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, int, int]] = []  # (a forward's features, first row, rows)
        self.tokens = 0

    def add(self, features: torch.Tensor, first: int, rows: int) -> None:
        self.parts.append((features, first, rows))
        self.tokens += rows
        if len(self.parts) > MAX_PARTS:
            self.tensor()

    def tensor(self) -> torch.Tensor:
        """The pending rows as one tensor [tokens, n_sel*H], which stays the log's one part."""
        if len(self.parts) != 1:
            self.parts = [(torch.cat([f[i : i + n] for f, i, n in self.parts]), 0, self.tokens)]
        features, first, rows = self.parts[0]
        return features[first : first + rows]

    def clear(self) -> None:
        self.parts, self.tokens = [], 0


class Request:
    """One generation: its inputs, its place in the sequence and what it has committed."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: frozenset[int] = frozenset(),
        min_tokens: int = 0,
        stats: GenerationStats | None = None,
    ):
        self.prompt_ids, self.sampling, self.min_tokens = list(prompt_ids), sampling, min_tokens
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids, self.stop_list = stop_token_ids, sorted(stop_token_ids)
        self.stats = stats if stats is not None else GenerationStats()
        self.gen = _generator(sampling.seed)
        self.t0 = time.perf_counter()
        self.start = 0  # position of `token`: committed, not yet fed to the target
        self.token = -1
        self.prefilled = 0  # prompt tokens already in the target cache (chunked prefill)
        self.head = 0  # tokens of the chat template's head it starts with: its first chunk, pinned in the prefix cache
        self.chunk_ends: list[int] = []  # where its canonical prefill chunks end, and their prefix-cache keys
        self.chunk_keys: list[bytes] = []
        self.history: NgramIndex | None = None  # prompt and committed tokens, where the batch looks guesses up
        self.counts: RequestCounts | None = (
            None  # prompt and committed tokens' n-grams, where the draft's prior reads them
        )
        self.features: PendingFeatures | None = None  # where a draft conditions on the target (Batch.add)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.stats.num_tokens

    def hold_stops(self, logits: torch.Tensor, first: int) -> torch.Tensor:
        """min_tokens: stop tokens get probability 0 at the rows (row j predicts generated token first + j) that come
        too early; the target's distribution is what changes, so verification stays exact."""
        rows = self.min_tokens - first
        if rows > 0 and self.stop_list:
            logits[:rows, self.stop_list] = float("-inf")
        return logits

    def commit(self, tokens: list[int]) -> list[int]:
        """Append decided tokens, cut at the first stop token and at the budget."""
        stats, out = self.stats, []
        for t in tokens[: self.remaining]:
            out.append(t)
            if t in self.stop_token_ids:
                stats.finish_reason = "stop"
                break
        stats.num_tokens += len(out)
        if self.counts is not None:
            self.counts.extend(out)
        if self.history is not None:
            self.history.extend(out)
        if not stats.finish_reason and stats.num_tokens >= self.max_new_tokens:
            stats.finish_reason = "length"
        stats.wall_time = time.perf_counter() - self.t0
        return out
