"""How many tokens to speculate per step: the block length that maximises expected committed tokens per second.

At batch 1 a block is nearly free to verify; at high batch every rejected slot costs real compute, and on a
chat prompt the draft may rarely be right. Each step the policy takes, for every candidate block length k,
the expected tokens committed (from each running row's own acceptance, position by position, shrunk toward
the population's) over the measured cost of drafting and verifying n*k tokens, and picks the best; k = 1 is
plain decoding. While it decodes plainly it still probes now and then with a full block, so acceptance stays
measured, but only when the block could pay were the rows as good as their evidence allows, and only as often as
PROBE_BUDGET of the plain steps' time covers the probe's extra cost: at high batch a full block costs several plain
steps, and a fixed probe rate would spend a large share of the server's time on them. TensorRT-LLM's `DFlashDecodingConfig` switches on fixed thresholds (`draft_len_schedule` by
batch size, `acceptance_rate_threshold`); here both sides of the trade are measured on the machine it runs on.
"""

from __future__ import annotations

import weakref

PRIOR = 0.6  # conditional acceptance assumed before anything is measured
PRIOR_WEIGHT = 4.0  # a row's own counts outweigh the population's after a few steps
PROBE_BUDGET = 0.03  # share of plain-decoding time a probe's extra cost may take
OPTIMISTIC = 0.9  # conditional acceptance a row is credited with, against its evidence, when deciding whether to probe
# Timing noise on a CPU only ever adds time (another thread, an interrupt), so a cost estimate falls fast and rises
# slowly: it settles near a low percentile of the measurements, and still follows a lasting slowdown within ~20 steps.
FALL, RISE = 0.5, 0.05


class BlockPolicy:
    def __init__(self, max_block: int, adaptive: bool = False):
        self.max_block, self.adaptive = max_block, adaptive and max_block > 1
        self.verify_cost: dict[int, float] = {}  # tokens in the step -> seconds (FALL/RISE average of measurements)
        self.draft_cost: dict[int, float] = {}
        self.reached = [0.0] * (max_block - 1)  # population: steps where slot j was drafted with all before accepted
        self.accepted = [0.0] * (max_block - 1)  # ... and slot j was accepted
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> (reached, accepted)
        self._plain_seconds = 0.0  # time in plain steps since the last block

    def _counts(self, req) -> tuple[list[float], list[float]]:
        return self._rows.get(req) or ([0.0] * (self.max_block - 1), [0.0] * (self.max_block - 1))

    def _conditional(self, counts, optimistic: bool = False) -> list[float]:
        """P(slot j accepted | slots before it were): the row's counts shrunk toward the population's (or, optimistic,
        toward OPTIMISTIC: what the row could still be, given its evidence)."""
        reached, accepted = counts
        out = []
        for j in range(self.max_block - 1):
            prior = OPTIMISTIC if optimistic else (self.accepted[j] + PRIOR * PRIOR_WEIGHT) / (self.reached[j] + PRIOR_WEIGHT)
            out.append((accepted[j] + prior * PRIOR_WEIGHT) / (reached[j] + PRIOR_WEIGHT))
        return out

    @staticmethod
    def _tokens(conditional: list[float], k: int) -> float:
        """Tokens a step with block length k commits on average: 1 + sum_j prod_{m<=j} p_m."""
        total, run = 1.0, 1.0
        for p in conditional[: k - 1]:
            run *= p
            total += run
        return total

    def expected_tokens(self, req, k: int) -> float:
        return self._tokens(self._conditional(self._counts(req)), k)

    @staticmethod
    def _estimate(costs: dict[int, float], tokens: int) -> float:
        """Cost of a forward over `tokens` tokens. A longer forward never costs less than a shorter one, so each
        measured point counts as the cheapest measurement at or beyond it (noise only adds time: a spike, say one
        taken while another process ran, cannot make a short block look dearer than a long one); linear in between,
        proportional beyond the largest."""
        level, low = {}, float("inf")
        for t in sorted(costs, reverse=True):
            low = min(low, costs[t])
            level[t] = low
        below = max((t for t in level if t <= tokens), default=None)
        above = min((t for t in level if t >= tokens), default=None)
        if above is None:
            return level[below] * tokens / below
        if below is None or below == above:
            return level[above]
        w = (tokens - below) / (above - below)
        return level[below] * (1 - w) + level[above] * w

    def step_cost(self, rows: int, k: int) -> float:
        cost = self._estimate(self.verify_cost, rows * k)
        return cost + (self._estimate(self.draft_cost, rows * k) if k > 1 else 0.0)

    def choose(self, rows: list) -> int:
        if not self.adaptive or not self.verify_cost or not self.draft_cost:
            return self.max_block
        best, best_rate = 1, 0.0
        for k in range(1, self.max_block + 1):
            gain = sum(self.expected_tokens(r, min(k, max(r.remaining, 1))) for r in rows)
            rate = gain / self.step_cost(len(rows), k)
            if rate > best_rate * 1.02:  # a longer block must pay clearly: ties go to less speculation
                best, best_rate = k, rate
        return self.max_block if best == 1 and self._probe_due(rows) else best

    def _probe_due(self, rows: list) -> bool:
        n, k = len(rows), self.max_block
        plain, block = self.step_cost(n, 1), self.step_cost(n, k)
        if self._plain_seconds * PROBE_BUDGET < block - plain:
            return False
        could = sum(self._tokens(self._conditional(self._counts(r), optimistic=True), min(k, max(r.remaining, 1))) for r in rows)
        return could / block > n / plain

    def record_cost(self, tokens: int, draft_seconds: float | None, verify_seconds: float) -> None:
        """A new size is stored as measured. A known one moves by FALL/RISE, and every other size moves by the same
        factor: what changes a step's cost while requests run (their contexts growing, a busier machine) changes all
        sizes alike, and the sizes not being chosen would otherwise keep their start-up cost and look cheap."""
        for costs, seconds in ((self.verify_cost, verify_seconds), (self.draft_cost, draft_seconds)):
            if seconds is None:
                continue
            old = costs.get(tokens)
            if not old:
                costs[tokens] = seconds
                continue
            scale = 1 + (FALL if seconds < old else RISE) * (seconds - old) / old
            for t in costs:
                costs[t] *= scale

    def observe(self, rows: list, k: int, budgets: list[int], accepted: list[int], draft_seconds: float, verify_seconds: float) -> None:
        """Learn from a finished step: its measured costs and each row's accepted run."""
        self._plain_seconds = self._plain_seconds + draft_seconds + verify_seconds if k == 1 else 0.0
        if not self.adaptive:
            return
        self.record_cost(len(rows) * k, draft_seconds if k > 1 else None, verify_seconds)
        for r, b, a in zip(rows, budgets, accepted):
            reached, acc = self._rows.setdefault(r, ([0.0] * (self.max_block - 1), [0.0] * (self.max_block - 1)))
            for j in range(min(a + 1, b - 1)):
                reached[j] += 1
                self.reached[j] += 1
                if j < a:
                    acc[j] += 1
                    self.accepted[j] += 1
