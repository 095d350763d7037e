"""How many tokens to speculate per step, per request: the block lengths that maximise expected committed tokens per
second.

At batch 1 a block is nearly free to verify; at high batch every rejected slot costs real compute, and on a chat
prompt the draft may rarely be right while on a math prompt beside it it is right three times in four. Each row
gets its own block length (the verify forward carries sum(k_i) tokens on one flat axis): starting from plain
decoding everywhere, the policy adds one slot at a time to the row whose next slot is likeliest to be accepted
(each row's own acceptance, position by position, shrunk toward the population's, times the share of such
estimates that rows drafting by choice went on to accept), prices each allocation with
the measured cost of verifying its tokens and drafting its drafting rows, and keeps the best. A row decoding
plainly is still probed so its acceptance stays measured, with the block that would serve it best were it as good as
its evidence allows and as the draft is known to be (its card's held-out acceptance; the full block where verifying is
cheap), and only where that block could pay: once when the row is new, then only as often as PROBE_BUDGET of its share
of the plain steps covers the probe's expected loss (its cost less what its expected tokens would take at the best
allocation's rate: a row near break-even is probed often, one the draft never serves rarely).
A greedy drafting row also learns the slot after its block: the draft guesses it too (one slot more of its forward),
and where every verified guess is accepted the bonus token says whether that guess was right (step.py), so a row
held at short blocks by other requests' record measures whether a longer one would pay, without paying to verify it.
A row whose recent tokens occurred before (lookup.py) may verify the tokens that followed them instead of drafting:
such a row costs only its verify tokens, and its block length (up to 1 + lookup.MAX_GUESSES, beyond the draft's block)
is priced with its own and all rows' record of lookup guesses, kept apart from the draft's.
TensorRT-LLM's `DFlashDecodingConfig` switches the whole batch on fixed thresholds (`draft_len_schedule` by batch
size, `acceptance_rate_threshold`); here both sides of the trade are measured on the machine it runs on, per request.
Above the per-row choice stands the draft length planned by batch size (plan.py) from whole steps measured at start-up
and the acceptance requests have shown: `planned` mode drafts exactly that length, as TensorRT-LLM does, and at a
batch size planned to draft nothing the adaptive policy decodes every row plainly.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass

from trtllm_dflash.engine.lookup import MAX_GUESSES
from trtllm_dflash.engine.plan import Acceptance, DraftSchedule, expected_tokens, plan_schedule
from trtllm_dflash.engine.step import StepRecord

PRIOR = 0.6  # conditional acceptance assumed before anything is measured
PRIOR_WEIGHT = 4.0  # a row's own counts outweigh the population's after a few steps
PROBE_BUDGET = 0.03  # share of a row's plain-decoding time a probe's extra cost may take
OPTIMISTIC = 0.9  # conditional acceptance a row is credited with, against its evidence, when deciding whether to probe,
# for a draft whose card states no held-out acceptance (else that acceptance: a draft that averages 0.74 a slot
# does not get a 0.9 probe at 8 rows, where the probe costs more than such a row could ever give back)
PROBE_MARGIN = 1.1  # ... and by how much that best case must beat the step without the probe (a probe's context update
# and first-block overheads are not in the cost estimates; at 8 rows on a 2-core CPU they are a third of its cost)
# Timing noise on a CPU only ever adds time (another thread, an interrupt), so a cost estimate falls fast and rises
# slowly: it settles near a low percentile of the measurements, and still follows a lasting slowdown within ~20 steps.
FALL, RISE = 0.5, 0.05
# Steps with drafting rows pay what one-row calibration forwards do not (the draft's context update, the per-row
# attention layout, the guesses' LM head): their measured/estimated ratio is learned apart from plain steps'.
FACTOR_RATE = 0.1
# A row drafts when its estimated acceptance is among the highest, so on average its estimate was lucky: drafting rows
# accept less than estimated (docs/performance.md#drafting-yield). The realized share of the expected extra tokens
# is learned from rows that drafted by choice (not probes): their accepted and expected extra tokens, summed with
# weights fading by YIELD_MEMORY a step that could draft, drafting or not, beside YIELD_PRIOR expected tokens at a
# share of 1 (a few steps' worth, so one failed warm-up step cannot turn later requests plain). A share learned low
# stops being measured (nothing then drafts by choice), so it must fade: held, one learned from a chat answer kept
# every later request plain (docs/performance.md#drafting-yield).
YIELD_MEMORY, YIELD_PRIOR = 0.97, 8.0
MARGIN = 1.02  # a longer block must beat the best shorter one by this much: ties go to less speculation
# Steps that could draft between plans of the draft length by batch size (plan.py) from the acceptance measured so far
# (a step where the plan drafts nothing measures none: the plan would come out the same).
REPLAN_STEPS = 16


@dataclass
class RowCounts:
    reached: list[float]  # [j]: steps where slot j was drafted with all before it accepted
    accepted: list[float]  # [j]: ... and slot j was accepted
    plain_seconds: float = 0.0  # this row's share of the steps that could draft since it last drafted


class BlockPolicy:
    def __init__(
        self,
        max_block: int,
        adaptive: bool = False,
        ragged: bool = True,
        ceiling: float = OPTIMISTIC,
        short: bool = False,
        planned: bool = False,
    ):
        """`ragged`: the target verifies rows of different lengths on one flat axis (else every row is padded to the
        longest, and a step costs n * max(k_i) tokens). `ceiling`: the per-slot acceptance a probe is priced with.
        `short`: the draft drafts a step's blocks over their longest k + 1 slots (DraftConfig.short_blocks), not whole.
        `planned`: every row drafts the draft length planned for the step's batch size (TensorRT-LLM's
        `draft_len_schedule`, from measured step costs and acceptance: `schedule`). An adaptive policy takes the same
        plan as an off switch: at a batch size planned to draft nothing, every row decodes plainly (no draft, no lookup,
        no probe), and the step costs what plain decoding does."""
        self.max_block, self.adaptive, self.ragged, self.ceiling = (
            max_block,
            adaptive and max_block > 1,
            ragged,
            ceiling,
        )
        self.short, self.planned = short, planned and max_block > 1
        self.step_seconds: dict[tuple[int, int], float] = {}  # (rows, draft length) -> a whole step's seconds
        self.schedule: DraftSchedule | None = None  # planned from step_seconds and the population's acceptance
        self._since_plan = 0  # steps observed since the schedule was planned
        self.verify_cost: dict[int, float] = {}  # tokens verified -> seconds (FALL/RISE average of measurements)
        self.draft_cost: dict[int, float] = {}  # drafting rows * slots drafted per row -> seconds
        self.population = self._new_counts()
        self.lookup_population = self._new_counts(lookup=True)  # the same counts for lookup guesses (lookup.py)
        # drafting step? -> measured / estimated cost (moving average). Drafting steps take the plain steps' factor until
        # one is measured: many rows cost more than the one-row calibration forwards either way, and a drafting factor
        # left at 1.0 beside a learned plain 1.3 made the first steps of a busy server draft every row (8 rows, fp32).
        self.factor: dict[bool, float | None] = {False: 1.0, True: None}
        self._yield = [0.0, 0.0]  # accepted and expected extra tokens of chosen drafting rows (fading sums)
        self._probed = None  # the row the last choice probed
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> RowCounts
        self._lookup_rows: weakref.WeakKeyDictionary = (
            weakref.WeakKeyDictionary()
        )  # request -> RowCounts of its lookups

    def _new_counts(self, lookup: bool = False) -> RowCounts:
        slots = MAX_GUESSES if lookup else self.max_block - 1
        return RowCounts([0.0] * slots, [0.0] * slots)

    @property
    def realized(self) -> float:
        """The share of their expected extra tokens that rows drafting by choice accept."""
        accepted, expected = self._yield
        return min(1.5, max(0.5, (accepted + YIELD_PRIOR) / (expected + YIELD_PRIOR)))

    def _counts(self, req) -> RowCounts:
        return self._rows.get(req) or self._new_counts()

    def _conditional(self, counts: RowCounts, optimistic: bool = False, pop: RowCounts | None = None) -> list[float]:
        """P(slot j accepted | slots before it were): the row's counts shrunk toward the population's (or, optimistic,
        toward the ceiling: what the row could still be, given its evidence). The population's slots are shrunk toward
        the slot before them: a slot never reached (a lookup row's beyond the draft's block, until one is verified)
        is taken to do as the last one measured, as a loop that held so far goes on, rather than as a fresh guess."""
        pop, out, before = pop or self.population, [], PRIOR
        for j in range(len(counts.accepted)):
            before = (pop.accepted[j] + before * PRIOR_WEIGHT) / (pop.reached[j] + PRIOR_WEIGHT)
            prior = self.ceiling if optimistic else before
            out.append((counts.accepted[j] + prior * PRIOR_WEIGHT) / (counts.reached[j] + PRIOR_WEIGHT))
        return out

    @staticmethod
    def _tokens(conditional: list[float], k: int) -> float:
        """Tokens a step with block length k (k - 1 guesses) commits on average."""
        return expected_tokens(conditional, k - 1)

    def planned_block(self, rows: int) -> int:
        """The block length the plan allows a step of `rows` rows (the whole block where the policy is fixed or has no
        plan yet)."""
        if self.schedule is None or not (self.planned or self.adaptive):
            return self.max_block
        return self.schedule.length_at(rows) + 1

    def speculates(self, rows: int) -> bool:
        """Whether a step of `rows` rows may verify any guess."""
        return self.max_block > 1 and self.planned_block(rows) > 1

    def expected_tokens(self, req, k: int) -> float:
        return self._tokens(self._conditional(self._counts(req)), k)

    def population_conditional(self) -> list[float]:
        """P(slot j accepted | the slots before it were) over every request so far, each slot shrunk toward the slot
        before it (PRIOR before anything is measured)."""
        out, before = [], PRIOR
        for reached, accepted in zip(self.population.reached, self.population.accepted):
            before = (accepted + before * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)
            out.append(before)
        return out

    def replan(self) -> None:
        """The draft length by batch size (plan.py) from the measured step costs (Batch.measure_steps) and the
        acceptance the requests showed so far."""
        self._since_plan = 0
        if not self.step_seconds:
            return
        acceptance = Acceptance(tuple(self.population_conditional()), "measured on this engine's requests")
        measured = sorted({b for b, _ in self.step_seconds})
        inputs = (("acceptance", acceptance.source), ("cost", "steps measured on this machine"))

        def cost(b: int, k: int) -> float:  # linear between the measured batch sizes
            i = bisect.bisect_left(measured, b)
            lo, hi = measured[max(i - 1, 0)], measured[i]
            w = (b - lo) / (hi - lo) if hi > lo else 1.0
            return self.step_seconds[lo, k] * (1 - w) + self.step_seconds[hi, k] * w

        self.schedule = plan_schedule(acceptance, cost, measured[-1], self.max_block - 1, inputs, every_size=True)

    @staticmethod
    def _levels(costs: dict[int, float]) -> list[tuple[int, float]]:
        """(tokens, cost) ascending, each point the cheapest measurement at or beyond it: a longer forward never
        costs less than a shorter one, and noise only adds time (a spike, say one taken while another process ran,
        cannot make a short block look dearer than a long one)."""
        out, low = [], float("inf")
        for t in sorted(costs, reverse=True):
            low = min(low, costs[t])
            out.append((t, low))
        return out[::-1]

    @staticmethod
    def _interpolate(levels: list[tuple[int, float]], tokens: int) -> float:
        """Linear between measured sizes, the smallest below them, proportional beyond the largest."""
        i = bisect.bisect_left(levels, (tokens, -1.0))
        if i == len(levels):
            t, c = levels[-1]
            return c * tokens / t
        t, c = levels[i]
        if t == tokens or i == 0:
            return c
        t0, c0 = levels[i - 1]
        w = (tokens - t0) / (t - t0)
        return c0 * (1 - w) + c * w

    def _estimate(self, costs: dict[int, float], tokens: int) -> float:
        """Cost of a forward over `tokens` tokens, from the measured sizes."""
        return self._interpolate(self._levels(costs), tokens)

    def verified_tokens(self, ks: list[int]) -> int:
        return sum(ks) if self.ragged else len(ks) * max(ks)

    def width(self, kmax: int) -> int:
        """Slots each drafting row drafts when the longest drafted block is kmax tokens: with a draft trained on short
        blocks, that block's and the spare guess's (propose.py; a sampling row has none), else the whole block."""
        return min(self.max_block, kmax + 1) if self.short else self.max_block

    def _curve(self, tokens: int, drafting: int, levels=None, width: int | None = None) -> float:
        """Seconds of a step verifying `tokens` tokens, `drafting` rows of it drafting `width` slots (default: the whole
        block), from the one-row measurements; `levels` saves re-sorting them when many allocations are priced."""
        verify, draft = levels or (self._levels(self.verify_cost), self._levels(self.draft_cost))
        cost = self._interpolate(verify, tokens)
        return cost + (self._interpolate(draft, drafting * (width or self.max_block)) if drafting else 0.0)

    def _factor(self, drafting: bool) -> float:
        f = self.factor[drafting]
        return self.factor[False] if f is None else f

    def _cost(self, tokens: int, drafting: int, levels=None, width: int | None = None) -> float:
        return self._curve(tokens, drafting, levels, width) * self._factor(drafting > 0)

    def step_cost(self, ks: list[int], levels=None) -> float:
        """Seconds of a step whose rows verify ks[i] tokens each (those with k > 1 drafting)."""
        return self._cost(self.verified_tokens(ks), sum(k > 1 for k in ks), levels, self.width(max(ks)))

    def choose(self, rows: list, lookup: list[int] | None = None) -> tuple[list[int], list[bool]]:
        """Block length per row (1 = plain decoding), never beyond what the row may still generate, and whether the
        row verifies lookup guesses rather than drafting. `lookup[i]`: how many lookup guesses row i has this step
        (0: none); a row that has them uses them, which measured better than the draft on every set (lookup.py). A
        lookup row's block may be longer than the draft's: up to all its guesses."""
        caps = [min(self.max_block, max(r.remaining, 1)) for r in rows]
        looked = [bool(lookup and lookup[i] and cap > 1) for i, cap in enumerate(caps)]
        caps = [
            min(max(r.remaining, 1), 1 + lookup[i]) if looked[i] else cap for i, (r, cap) in enumerate(zip(rows, caps))
        ]
        planned = self.planned_block(len(rows))
        if self.planned or planned == 1:  # every row at the planned length, lookup guesses within it too (1: none)
            caps = [min(cap, planned) for cap in caps]
            self._probed = None
            return caps, [lk and cap > 1 for lk, cap in zip(looked, caps)]
        if not self.adaptive or not self.verify_cost or not self.draft_cost:
            return caps, looked
        levels = (self._levels(self.verify_cost), self._levels(self.draft_cost))
        conditional = [
            self._conditional(self._lookup_rows.get(r) or self._new_counts(lookup=True), pop=self.lookup_population)
            if looked[i]
            else self._conditional(self._counts(r))
            for i, r in enumerate(rows)
        ]
        n, y = len(rows), self.realized
        # of ks: tokens, drafting rows, longest block, longest drafted block
        ks, gain, tokens, drafting, kmax, kdraft = [1] * n, float(n), n, 0, 1, 1
        # y (drafting rows accept less than estimated) is learned from drafting rows; a lookup row is not chosen for a
        # lucky estimate of the draft, so its own counts stand
        yields = [1.0 if lk else y for lk in looked]
        most = gain + sum(
            w * (self._tokens(c, cap) - 1) for w, c, cap in zip(yields, conditional, caps)
        )  # every row at its longest block
        nxt = [w * c[0] if cap > 1 else -1.0 for w, c, cap in zip(yields, conditional, caps)]  # expected tokens row i's
        # next slot adds (the product of its conditionals so far); -1: the row is at its cap
        best, best_gain, best_rate = list(ks), gain, gain / self._cost(n, 0, levels)
        while True:
            i = max(range(n), key=nxt.__getitem__)
            if nxt[i] < 0:
                break
            gain += nxt[i]
            ks[i] += 1
            tokens, drafting, kmax = tokens + 1, drafting + (ks[i] == 2 and not looked[i]), max(kmax, ks[i])
            kdraft = kdraft if looked[i] else max(kdraft, ks[i])
            nxt[i] = -1.0 if ks[i] == caps[i] else nxt[i] * conditional[i][ks[i] - 1]
            cost = self._cost(tokens if self.ragged else n * kmax, drafting, levels, self.width(kdraft))
            if gain / cost > best_rate * MARGIN:
                best, best_gain, best_rate = list(ks), gain, gain / cost
            elif most / cost <= best_rate * MARGIN:
                break  # costs only grow from here: not even every slot accepted could beat the best
        probe = self._probe(rows, best, best_gain, caps, levels, looked)
        self._probed = rows[probe[0]] if probe else None
        if probe:
            best[probe[0]] = probe[1]
        return best, [lk and k > 1 for lk, k in zip(looked, best)]

    def _probe(
        self, rows: list, ks: list[int], gain: float, caps: list[int], levels, looked: list[bool]
    ) -> tuple[int, int] | None:
        """The plain row that is due a probe, and its block, if any: a row never measured (one block in its life tells
        the policy what the population's average cannot: whether this request is one the draft serves), else the one
        longest plain whose share of the plain steps' time covers the probe's expected loss within PROBE_BUDGET. The
        block is the one that would serve the row best were it as good as its evidence allows and the draft is known
        to be: the full block where verifying is cheap, a shorter one where a full one could never pay."""
        counts = {i: self._counts(rows[i]) for i, k in enumerate(ks) if k == 1 and caps[i] > 1 and not looked[i]}
        if not counts:
            return None
        n, tokens, kmax = len(ks), self.verified_tokens(ks), max(ks)
        drafted = [k for k, lk in zip(ks, looked) if k > 1 and not lk]
        drafting, kdraft = len(drafted), max(drafted, default=1)
        base = self._cost(tokens, drafting, levels, self.width(kdraft))

        def cost_with(k: int) -> float:  # the step with one more row drafting, at block k
            return self._cost(
                tokens + k - 1 if self.ragged else n * max(kmax, k), drafting + 1, levels, self.width(max(kdraft, k))
            )

        plans: dict[tuple, tuple[float, int]] = {}  # evidence -> (best case's rate, block): rows never measured all
        # have the same evidence, priced once per cap
        for i in sorted(counts, key=lambda i: (counts[i].reached[0] > 0, -counts[i].plain_seconds)):
            c, cap = counts[i], caps[i]
            key = (cap, *c.reached, *c.accepted)
            if key not in plans:
                could = self._conditional(c, optimistic=True)
                plans[key] = max(((gain - 1 + self._tokens(could, k)) / cost_with(k), k) for k in range(2, cap + 1))
            rate, k = plans[key]
            if rate <= PROBE_MARGIN * gain / base:
                continue
            if (
                c.reached[0] > 0
            ):  # measured before: the probe's cost less what its expected tokens take at the best rate
                expected = gain + self.realized * (self._tokens(self._conditional(c), k) - 1)
                if c.plain_seconds * PROBE_BUDGET < cost_with(k) - expected * base / gain:
                    return None  # the rows after it have less plain time behind them
            return i, k
        return None

    def record_cost(
        self, tokens: int, draft_seconds: float | None, verify_seconds: float | None, draft_tokens: int | None = None
    ) -> None:
        """A step that verified `tokens` tokens and drafted `draft_tokens` (rows x slots each; default `tokens`; None:
        not measured). A new size is stored as measured. A known one moves by FALL/RISE, and every other size moves by
        the same factor: what changes a step's cost while requests run (their contexts growing, a busier machine)
        changes all sizes alike, and the sizes not being chosen would otherwise keep their start-up cost and look cheap."""
        for costs, size, seconds in (
            (self.verify_cost, tokens, verify_seconds),
            (self.draft_cost, tokens if draft_tokens is None else draft_tokens, draft_seconds),
        ):
            if seconds is None:
                continue
            old = costs.get(size)
            if not old:
                costs[size] = seconds
                continue
            scale = 1 + (FALL if seconds < old else RISE) * (seconds - old) / old
            for t in costs:
                costs[t] *= scale

    def observe(self, rows: list, step: StepRecord) -> None:
        """Learn from a finished step (step.py): its measured costs and each row's accepted run (`step.looked[i]`: row
        i verified lookup guesses; `step.beyond[i]`: where row i's guesses were all accepted, whether its guess for the
        slot after its block was the target's token too; `step.width`: the slots each drafting row drafted)."""
        ks, accepted = step.ks, step.accepted
        draft_seconds, verify_seconds = step.draft_seconds, step.verify_seconds
        looked, width = step.looked or (False,) * len(rows), step.width or self.max_block
        if not (self.adaptive or self.planned):
            return
        if max(ks) == 1 and not self.speculates(len(rows)):
            return  # a plain step where the plan drafts nothing: its costs price no choice, it reaches no slot
        self._since_plan += 1
        if self._since_plan >= REPLAN_STEPS:
            self.replan()
        if self.planned:  # the acceptance counts alone: the plan's costs are measured whole
            self._count(rows, step)
            return
        drafting = sum(k > 1 and not lk for k, lk in zip(ks, looked))
        chosen = [
            (r, k, a) for r, k, a, lk in zip(rows, ks, accepted, looked) if k > 1 and not lk and r is not self._probed
        ]
        self._probed = None  # not kept: a retired request would stay alive until the next choice
        got, expected = self._yield
        self._yield = [
            got * YIELD_MEMORY + sum(a for _, _, a in chosen),
            expected * YIELD_MEMORY + sum(self.expected_tokens(r, k) - 1 for r, k, _ in chosen),
        ]
        if self.verify_cost and (self.draft_cost or not drafting):
            f = self._factor(drafting > 0)
            ratio = (draft_seconds + verify_seconds) / max(
                self._curve(self.verified_tokens(ks), drafting, width=width), 1e-9
            )
            self.factor[drafting > 0] = min(3.0, max(0.5, f + FACTOR_RATE * (ratio - f)))
        self.record_cost(
            self.verified_tokens(ks), draft_seconds if drafting else None, verify_seconds, draft_tokens=drafting * width
        )
        self._count(rows, step)

    def _count(self, rows: list, step: StepRecord) -> None:
        """Each row's and the population's acceptance counts, and each row's time since it last drafted."""
        share, looked, beyond = (step.draft_seconds + step.verify_seconds) / len(rows), step.looked, step.beyond
        for i, (r, b, a, lk) in enumerate(zip(rows, step.ks, step.accepted, looked or (False,) * len(rows))):
            table, pop = (self._lookup_rows, self.lookup_population) if lk else (self._rows, self.population)
            counts = table.get(r)
            if counts is None:
                counts = table[r] = self._new_counts(lookup=lk)
            if not lk:  # time since the row last drafted: lookup steps are not drafting
                counts.plain_seconds = counts.plain_seconds + share if b == 1 else 0.0
            elif r in self._rows:
                self._rows[r].plain_seconds += share
            hits = [j < a for j in range(min(a + 1, b - 1))]  # slot j reached, and accepted
            if beyond and beyond[i] is not None and not lk and a == b - 1 and 1 < b < self.max_block:
                hits.append(beyond[i])
            for j, hit in enumerate(hits):
                counts.reached[j] += 1
                pop.reached[j] += 1
                if hit:
                    counts.accepted[j] += 1
                    pop.accepted[j] += 1
