"""The block-length policy (policy.py) decides from measured costs and acceptance: its estimates and choices."""

from trtllm_dflash.policy import PROBE_EVERY, BlockPolicy


class Row:
    remaining = 100


def feed(policy: BlockPolicy, row, accepted_runs: list[int]) -> None:
    """Full-block steps in which `row` got these numbers of drafts accepted."""
    for a in accepted_runs:
        policy.observe([row], policy.max_block, [policy.max_block], [a], draft_seconds=0.0, verify_seconds=0.0)


def test_a_noise_spike_cannot_make_a_short_forward_dearer_than_a_longer_one():
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({1: 0.900, 2: 0.040, 4: 0.041, 8: 0.045})  # 1 token measured while something else ran
    assert p._estimate(p.verify_cost, 1) == 0.040
    assert p._estimate(p.verify_cost, 3) == 0.0405
    assert p._estimate(p.verify_cost, 16) == 0.090  # beyond the largest: proportional


def test_costs_fall_fast_and_rise_slowly():
    p = BlockPolicy(8, adaptive=True)
    p.record_cost(8, None, 0.040)
    p.record_cost(8, None, 0.400)  # one spike moves the estimate by a twentieth of itself
    assert p.verify_cost[8] < 0.060
    for _ in range(60):  # a lasting slowdown is followed
        p.record_cost(8, None, 0.080)
    assert p.verify_cost[8] > 0.075
    p.record_cost(8, None, 0.040)
    assert p.verify_cost[8] < 0.061


def test_flat_costs_and_good_acceptance_draft_the_full_block():
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({t: 0.040 + 0.0002 * t for t in (1, 2, 4, 8)})  # batch 1 on a memory-bound target
    p.draft_cost.update({t: 0.010 for t in (2, 4, 8)})
    row = Row()
    feed(p, row, [7, 4, 7, 2, 6, 7] * 4)
    assert p.choose([row]) == 8
    stuck = Row()  # a row whose sixth guess is always wrong: verifying beyond it costs and never pays
    feed(p, stuck, [5] * 24)
    assert p.choose([stuck]) == 6


def test_compute_bound_costs_and_a_draft_that_misses_decode_plainly_then_probe():
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({t: 0.002 * t for t in (16, 32, 64, 128)})  # 16 rows: every token costs
    p.draft_cost.update({t: 0.001 * t for t in (32, 64, 128)})
    rows = [Row() for _ in range(16)]
    for r in rows:
        feed(p, r, [0] * 10)
    assert p.choose(rows) == 1
    for _ in range(PROBE_EVERY):
        p.observe(rows, 1, [1] * 16, [0] * 16, draft_seconds=0.0, verify_seconds=0.032)
    assert p.choose(rows) == 8  # after PROBE_EVERY plain steps one full block keeps acceptance measured


def test_sizes_not_chosen_follow_the_measured_ones():
    """Start-up costs are measured at an empty context; once contexts grow, the sizes the policy keeps choosing get
    dearer, and the others must too, or a shorter block would look cheaper than it is."""
    p = BlockPolicy(8, adaptive=True)
    for t, cost in ((1, 0.040), (2, 0.041), (4, 0.043), (8, 0.050)):
        p.record_cost(t, 0.010 if t > 1 else None, cost)
    for _ in range(200):  # full blocks at a long context: twice the start-up cost
        p.record_cost(8, 0.020, 0.100)
    assert abs(p.verify_cost[8] - 0.100) < 0.002 and abs(p.draft_cost[8] - 0.020) < 0.001
    assert abs(p._estimate(p.verify_cost, 4) - 0.086) < 0.002  # the calibrated ratio 43/50, at today's level
    assert abs(p.step_cost(1, 4) / p.step_cost(1, 8) - (0.043 + 0.010) / (0.050 + 0.010)) < 0.01
