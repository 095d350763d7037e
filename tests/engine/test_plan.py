"""The draft length by batch size on the embedded engine (engine/plan.py, BlockPolicy's `planned` mode): planned from
whole steps measured on this machine and the acceptance measured on real prompts, it comes within 10 % of the best
fixed draft length measured at 1, 4 and 16 rows; a batch size planned to draft nothing decodes plainly in both
measured modes."""

import time

import pytest

from trtllm_dflash.clients.loadgen import default_prompts
from trtllm_dflash.engine.batch import Batch
from trtllm_dflash.engine.plan import Acceptance, conditional_for_tau, plan_schedule
from trtllm_dflash.engine.policy import BlockPolicy
from trtllm_dflash.engine.request import Request
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.engine.step import StepRecord

TOKENS = 48  # per request at every fixed draft length
ROUNDS = 2


class Row:
    remaining = 100


def measured_policy(seconds: dict[tuple[int, int], float], **kw) -> BlockPolicy:
    p = BlockPolicy(8, **kw)
    p.step_seconds = seconds
    p.replan()
    return p


def cheap_until(rows: int) -> dict[tuple[int, int], float]:
    """Steps whose drafting is nearly free up to `rows` rows and costs as much as its tokens beyond."""
    return {(b, k): 0.010 + (0.0005 * k if b <= rows else 0.002 * b * k) for b in (1, 2, 4, 8, 16) for k in range(8)}


def test_planned_policy_drafts_the_planned_length_and_nothing_where_none_pays():
    planned = measured_policy(cheap_until(4), planned=True)
    lengths = {b: planned.schedule.length_at(b) for b in (1, 4, 8, 16)}
    assert lengths[1] == lengths[4] > 0 and lengths[8] == lengths[16] == 0
    for n in (1, 4, 16):
        rows = [Row() for _ in range(n)]
        assert planned.choose(rows, [0] * n) == ([lengths[n] + 1] * n, [False] * n)
    # a lookup row gets no longer a block than the plan allows, and none where the plan drafts nothing
    assert planned.choose([Row(), Row()], [9, 0]) == ([lengths[1] + 1] * 2, [True, False])
    assert planned.choose([Row()] * 16, [9] + [0] * 15) == ([1] * 16, [False] * 16)


def test_adaptive_policy_takes_the_plan_as_its_off_switch():
    """Where the plan drafts nothing, no row drafts, looks up or is probed (new rows otherwise are, at once)."""
    p = measured_policy(cheap_until(4), adaptive=True)
    p.verify_cost.update({1: 0.010, 32: 0.0102, 128: 0.05})
    p.draft_cost.update({8: 0.002, 128: 0.01})
    assert max(p.choose([Row(), Row()])[0]) > 1 and p.speculates(2)  # where the plan drafts, the policy's own choice
    assert p.choose([Row()] * 16, [9] + [0] * 15) == ([1] * 16, [False] * 16) and not p.speculates(16)


def test_a_plain_step_where_the_plan_drafts_nothing_teaches_the_policy_nothing():
    """Such a step must cost what a draft-free engine's does: its costs price no choice (the policy chooses nothing
    there), its rows reach no slot and a replan would come out the same, so observing it changes nothing. Where the
    plan drafts, the same plain step is learnt from."""
    p = measured_policy(cheap_until(4), adaptive=True)
    p.verify_cost.update({1: 0.010, 16: 0.0102, 128: 0.05})
    p.draft_cost.update({8: 0.002, 128: 0.01})
    p._yield = [4.0, 5.0]  # drafting rows so far accepted 4 of 5 expected extra tokens

    def learnt():
        return dict(p.verify_cost), dict(p.factor), list(p._yield), p._since_plan, len(p._rows)

    before = learnt()
    busy = [Row() for _ in range(16)]
    p.observe(busy, StepRecord(ks=[1] * 16, accepted=[0] * 16, draft_seconds=0.0, verify_seconds=0.03))
    assert learnt() == before
    p.observe(busy[:2], StepRecord(ks=[1] * 2, accepted=[0] * 2, draft_seconds=0.0, verify_seconds=0.03))
    after = learnt()
    assert all(a != b for a, b in zip(after, before))


def test_plan_follows_the_acceptance():
    """The same costs: a draft accepted often drafts long at more rows than one seldom accepted."""
    seconds = {(b, k): 0.010 + 0.0004 * b * k for b in (1, 2, 4, 8, 16) for k in range(8)}
    good = plan_schedule(Acceptance((conditional_for_tau(5.0, 8),) * 7, "good"), lambda b, k: seconds[b, k], 16, 7)
    poor = plan_schedule(Acceptance((conditional_for_tau(1.5, 8),) * 7, "poor"), lambda b, k: seconds[b, k], 16, 7)
    assert all(good.length_at(b) >= poor.length_at(b) for b in (1, 2, 4, 8, 16))
    assert good.length_at(16) > poor.length_at(16)


def fixed_length_rates(engine: DFlashEngine, batch: Batch, prompts: list[list[int]], rows: int) -> dict[int, float]:
    """Committed tokens per second at every fixed draft length while `rows` requests run (until the first has its
    TOKENS): the same prompts at every length, so the same text (greedy output does not depend on the length), and
    the policy learns the acceptance from these steps. The lengths take turns, forward then backward."""
    tokens, seconds = dict.fromkeys(range(engine.block_size), 0), dict.fromkeys(range(engine.block_size), 0.0)
    for rnd in range(ROUNDS):
        for k in range(engine.block_size)[:: 1 if rnd % 2 == 0 else -1]:
            for g in range(0, max(rows, 4), rows):
                reqs = [Request(ids, TOKENS) for ids in prompts[g : g + rows]]
                for r in reqs:
                    while not batch.add(r):
                        pass
                while len(batch.ready) == rows:
                    t0 = time.perf_counter()
                    out = batch.step([k + 1] * rows)
                    seconds[k] += time.perf_counter() - t0
                    tokens[k] += sum(map(len, out.values()))
                for r in reqs:
                    batch.remove(r)
    return {k: tokens[k] / seconds[k] for k in tokens}


@pytest.mark.slow
def test_planned_length_comes_within_ten_percent_of_the_best_fixed_length():
    engine = DFlashEngine.load("smollm2-135m", speculation="planned", progress=lambda m: None)
    batch = Batch(engine.target, engine.draft, engine.block_size, slots=16, policy=engine.policy, lookup=False)
    engine.calibrate(batch)
    prompts = [engine.encode(p) for p in default_prompts(8)]
    rates = {rows: fixed_length_rates(engine, batch, prompts, rows) for rows in (1, 4, 16)}
    engine.policy.replan()  # with the acceptance these steps measured
    for rows, rate in rates.items():
        k = engine.policy.schedule.length_at(rows)
        best = max(rate, key=rate.get)
        assert rate[k] >= 0.9 * rate[best], (rows, k, best, rate, engine.policy.schedule.table())
