"""Draft length by load: per batch size, the draft length K with the most expected committed tokens per second.

A step with draft length K commits E(K) = 1 + p_1 + p_1 p_2 + ... + p_1...p_K tokens per request (p_j: the draft's
conditional acceptance at position j) and costs T(batch, K). Speculation pays while verifying K more tokens per row
is cheap, which holds where a step is bound by reading weights; as the batch grows the step becomes bound by
compute, every rejected guess costs real work, and the best K falls, to 0 (no drafting) eventually. The result has
the shape of TensorRT-LLM's `speculative_config.draft_len_schedule`.

Two inputs: the acceptance per position (a draft card's acceptance length, or measured) and T (a GPU's roofline,
deploy/schedule.py, or steps measured on the machine that serves: Batch.measure_steps). The embedded engine plans
with measured T and the acceptance its requests show (BlockPolicy.replan); a GPU deployment with the roofline and
the draft card's.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trtllm_dflash.errors import DFlashError

# Drafting at a batch size above one must promise this many times the tokens per second of not drafting. Both inputs
# are estimates that err toward drafting: the acceptance is the average of requests so far, a measured step leaves out
# the draft catching up on context committed while it did not draft, and of many near-equal choices the one that
# looks best is the one most likely overrated. A plan drafting for a promised gain of a few percent lost more than
# that when served (docs/performance.md#draft-length-by-load).
MIN_SPEEDUP = 1.05


def expected_tokens(conditional: Sequence[float], k: int) -> float:
    """Tokens a step with draft length k commits per request on average, the bonus token included:
    1 + sum_j prod_{m<=j} p_m over the first k positions."""
    total, run = 1.0, 1.0
    for p in conditional[:k]:
        run *= p
        total += run
    return total


def conditional_for_tau(tau: float, block: int) -> float:
    """The constant per-position acceptance p with 1 + p + ... + p^(block - 1) = tau: what one published acceptance
    length (τ at a block size, the bonus token counted) allows."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens([mid] * (block - 1), block - 1) < tau else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Acceptance:
    """The draft's conditional acceptance per position (p_j, j = 1..max) and where it comes from."""

    conditional: tuple[float, ...]
    source: str

    @classmethod
    def from_tau(cls, tau: float, block_size: int, source: str) -> Acceptance:
        if not 1.0 <= tau <= block_size:
            raise DFlashError(f"An acceptance length must lie between 1 and the block size {block_size}, got {tau}.")
        p = conditional_for_tau(tau, block_size)
        return cls((p,) * (block_size - 1), f"{source}: τ {tau:g} at block {block_size}")

    @classmethod
    def from_profile(cls, profile: dict, source: str) -> Acceptance:
        """A speculation profile's measured conditional acceptance per draft position (`trtdflash bench --dataset`
        writes it: clients/specbench.profile); a position it did not measure counts as never accepted."""
        p = profile.get("conditional") if isinstance(profile, dict) else None
        if not isinstance(p, list) or not p or not all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in p):
            raise DFlashError(f"{source}: 'conditional' must be a list of acceptance rates between 0 and 1.")
        return cls(tuple(float(x) for x in p), f"{source}: measured, τ {expected_tokens(p, len(p)):.2f}")

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.conditional, k)


@dataclass(frozen=True)
class Planned:
    batch: int
    draft_len: int
    tokens_per_step: float  # per request, bonus included
    speedup: float  # committed tokens per second against the same batch without drafting


@dataclass(frozen=True)
class DraftSchedule:
    """The planned draft length per batch size (1..max_batch_size, powers of two and the maximum), with its inputs.

    Invariants: rows ascend by batch from 1; the batch-1 length is at least 1 and no later length exceeds it."""

    rows: tuple[Planned, ...]
    max_batch_size: int
    inputs: tuple[tuple[str, str], ...]

    def length_at(self, batch: int) -> int:
        """The planned length of `batch` rows: that of the nearest planned batch size at or below it (the engine asks
        every step)."""
        return self.rows[bisect.bisect_right(self.rows, batch, key=lambda r: r.batch) - 1].draft_len

    @property
    def max_draft_len(self) -> int:
        return self.length_at(1)

    def schedule(self) -> dict[int, int]:
        """TensorRT-LLM's `draft_len_schedule`: both ends of every run of equal lengths, so that the readings of its
        keys before and after TensorRT-LLM 1.3 (deploy/schedule.py) give every batch size its planned length."""
        out: dict[int, int] = {}
        start, k = 1, self.length_at(1)
        for b in range(2, self.max_batch_size + 2):
            kb = self.length_at(b) if b <= self.max_batch_size else None
            if kb != k:
                out[start], out[b - 1] = k, k
                start, k = b, kb
        return out

    def table(self) -> str:
        lines = ["| batch | draft length | tokens/step | expected speed-up |", "|---:|---:|---:|---:|"]
        lines += [f"| {r.batch} | {r.draft_len} | {r.tokens_per_step:.2f} | {r.speedup:.2f}x |" for r in self.rows]
        lines += ["", "Inputs: " + "; ".join(f"{k} {v}" for k, v in self.inputs) + "."]
        return "\n".join(lines)


def batch_sizes(max_batch_size: int) -> list[int]:
    return sorted({2**i for i in range(max_batch_size.bit_length()) if 2**i <= max_batch_size} | {max_batch_size})


def plan_schedule(
    acceptance: Acceptance,
    cost: Callable[[int, int], float],
    max_batch_size: int,
    max_draft_len: int,
    inputs: tuple[tuple[str, str], ...] = (),
    every_size: bool = False,
) -> DraftSchedule:
    """Per batch size (1, 2, 4, ... and max_batch_size; `every_size`: each from 1 to max_batch_size), the draft length
    with the most expected tokens per second (the shorter on a tie), or 0 where that is less than MIN_SPEEDUP times
    the rate without drafting; `cost(batch, k)` is a step's seconds. Batch 1 chooses among 1..max_draft_len (TensorRT-LLM takes no DFlash deployment with max_draft_len 0: the twin without a
    draft is the way to turn drafting off), and every larger batch among 0..that length, since TensorRT-LLM requires
    every scheduled length to be at most the batch-1 one."""
    if max_draft_len < 1 or max_batch_size < 1:
        raise DFlashError(f"Cannot plan draft lengths up to {max_draft_len} for batches up to {max_batch_size}.")
    rows, top = [], max_draft_len
    for b in range(1, max_batch_size + 1) if every_size else batch_sizes(max_batch_size):
        rate = {k: acceptance.expected_tokens(k) / cost(b, k) for k in range(top + 1)}
        k = max((k for k in rate if k > 0 or b > 1), key=lambda k: (rate[k], -k))
        k = 0 if b > 1 and rate[k] < MIN_SPEEDUP * rate[0] else k
        top = k if b == 1 else top
        rows.append(Planned(b, k, acceptance.expected_tokens(k), rate[k] / rate[0]))
    return DraftSchedule(tuple(rows), max_batch_size, inputs)
