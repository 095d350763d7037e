"""The draft length by batch size on the embedded engine (engine/plan.py, BlockPolicy's `planned` mode): planned from
whole steps measured on this machine and the acceptance measured on real prompts, it comes within 10 % of the best
fixed draft length measured at 1, 4 and 16 rows; a batch size planned to draft nothing decodes plainly in both
measured modes."""

import statistics
import time
import types

import pytest

from trtllm_dflash.clients.loadgen import default_prompts
from trtllm_dflash.engine import batch as batch_module
from trtllm_dflash.engine.batch import STEP_ROUNDS, Batch
from trtllm_dflash.engine.plan import Acceptance, conditional_for_tau, plan_schedule
from trtllm_dflash.engine.policy import BlockPolicy
from trtllm_dflash.engine.request import Request
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.engine.step import StepRecord
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.resolve import DRAFTS_DIR

TOKENS = 48  # per request at every fixed draft length


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
    there), its rows reach no slot and a replan would come out the same, so observing it changes nothing but that
    step's measured cost (the next test). Where the plan drafts, the same plain step is learnt from."""
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


def test_measured_steps_price_each_length_by_its_ratio_to_the_plain_step_of_its_round(target, monkeypatch):
    """Real steps on a clock that runs 1.5x slow throughout (another process busy) but for one quiet plain step, with
    one spike: each length costs the plain step's fastest times its true ratio to it. Each length's fastest alone
    would price every drafting step 1.5x too dear and plan plain decoding where drafting pays."""
    draft = load_draft(DRAFTS_DIR / "smollm2-135m")
    target.set_taps(draft.config.target_layer_ids)
    block = draft.config.block_size
    policy = BlockPolicy(block, planned=True)
    batch = Batch(target, draft, block, slots=2, policy=policy, lookup=False)
    clock = types.SimpleNamespace(now=0.0, steps=0)
    monkeypatch.setattr(batch_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    real_step = batch.step

    def step(ks, observe=True):
        out = real_step(ks, observe=observe)
        k, i = ks[0] - 1, clock.steps % (1 + STEP_ROUNDS * 2 * (block - 1))  # the i-th step at this batch size
        turn, quiet = (i - 1) // (2 * block - 2), i == 0  # quiet: the first plain step
        clock.now += 0.010 * (1 + 0.1 * k) * (1.0 if quiet else 1.5) * (4.0 if (turn, k) == (1, 2) else 1.0)
        clock.steps += 1
        return out

    monkeypatch.setattr(batch, "step", step)
    batch.measure_steps()
    assert policy.step_seconds.keys() == {(b, k) for b in (1, 2) for k in range(block)}
    for (b, k), seconds in policy.step_seconds.items():
        assert seconds == pytest.approx(0.010 * (1 + 0.1 * k)), (b, k)
    assert policy.schedule.length_at(2) > 0


def test_plan_follows_the_acceptance():
    """The same costs: a draft accepted often drafts long at more rows than one seldom accepted."""
    seconds = {(b, k): 0.010 + 0.0004 * b * k for b in (1, 2, 4, 8, 16) for k in range(8)}
    good = plan_schedule(Acceptance((conditional_for_tau(5.0, 8),) * 7, "good"), lambda b, k: seconds[b, k], 16, 7)
    poor = plan_schedule(Acceptance((conditional_for_tau(1.5, 8),) * 7, "poor"), lambda b, k: seconds[b, k], 16, 7)
    assert all(good.length_at(b) >= poor.length_at(b) for b in (1, 2, 4, 8, 16))
    assert good.length_at(16) > poor.length_at(16)


def fixed_length_rates(engine: DFlashEngine, prompts: list[list[int]], rows: int) -> dict[int, float]:
    """Committed tokens per second at every fixed draft length while `rows` requests run (until the first has its
    TOKENS), in plain steps' seconds: the same prompts at every length, so the same text (greedy output does not
    depend on the length), and the policy learns the acceptance from these steps. Each length has
    a batch of its own and the batches take turns step by step (forward then backward); a length's step costs the
    median over turns of its seconds over the plain step's in the same turn. So neither a spike nor a slower spell of
    this shared machine falls on some lengths and not on others."""
    lengths = range(engine.block_size)
    batches = [
        Batch(engine.target, engine.draft, engine.block_size, rows, engine.policy, lookup=False) for _ in lengths
    ]
    tokens, steps, relative = [0] * len(lengths), [0] * len(lengths), [[] for _ in lengths]
    for g in range(0, max(rows, 4), rows):
        reqs = [[Request(ids, TOKENS) for ids in prompts[g : g + rows]] for _ in lengths]
        for batch, group in zip(batches, reqs):
            for r in group:
                while not batch.add(r):
                    pass
        order = list(lengths)
        while len(batches[0].ready) == rows:  # plain steps commit fewest tokens: the plain batch runs longest
            seconds = {}
            for k in order:
                if len(batches[k].ready) == rows:
                    t0 = time.perf_counter()
                    out = batches[k].step([k + 1] * rows)
                    seconds[k] = time.perf_counter() - t0
                    tokens[k] += sum(map(len, out.values()))
                    steps[k] += 1
            for k, t in seconds.items():
                relative[k].append(t / seconds[0])
            order.reverse()
        for batch, group in zip(batches, reqs):
            for r in group:
                batch.remove(r)
    return {k: tokens[k] / steps[k] / statistics.median(relative[k]) for k in lengths}


@pytest.mark.slow
def test_planned_length_comes_within_ten_percent_of_the_best_fixed_length():
    # bf16 weights: on 4-bit ones (the default with AVX-512 BF16) the rates at one row lie within a few percent of each
    # other from length 2 to 6, and the plan landed 6-12 % short of the best (docs/performance.md#open-questions)
    engine = DFlashEngine.load("smollm2-135m", speculation="planned", weights="bf16", progress=lambda m: None)
    batch = Batch(engine.target, engine.draft, engine.block_size, slots=16, policy=engine.policy, lookup=False)
    engine.calibrate(batch)
    prompts = [engine.encode(p) for p in default_prompts(8)]
    short: dict = {1: None, 4: None, 16: None}
    for _ in range(2):  # a slow spell of this shared machine can move one measurement; a wrong plan falls short twice
        rates = {rows: fixed_length_rates(engine, prompts, rows) for rows in short}
        engine.policy.replan()  # with the acceptance and the step costs these steps measured
        short = {}
        for rows, rate in rates.items():
            k = engine.policy.schedule.length_at(rows)
            best = max(rate, key=rate.get)
            if rate[k] < 0.9 * rate[best]:
                priced = [
                    round(engine.policy.step_seconds[rows, j] / engine.policy.step_seconds[rows, 0], 2) for j in rate
                ]
                short[rows] = (k, best, rate, priced, engine.policy.population_conditional())
        if not short:
            break
    assert not short, short
