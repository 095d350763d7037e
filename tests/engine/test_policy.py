"""The block-length policy (policy.py) decides from measured costs and acceptance: its estimates and choices."""

import pytest

from trtllm_dflash.engine.plan import conditional_for_tau
from trtllm_dflash.engine.policy import BlockPolicy
from trtllm_dflash.engine.step import StepRecord


class Row:
    remaining = 100


def feed(policy: BlockPolicy, row, accepted_runs: list[int]) -> None:
    """Full-block steps in which `row` got these numbers of drafts accepted, each costing what the policy expects: a
    history of the row's acceptance (the realized share, learned from the steps the policy chose, is left alone)."""
    k, realized = policy.max_block, list(policy._yield)
    for a in accepted_runs:
        policy.observe(
            [row],
            StepRecord(
                ks=[k],
                accepted=[a],
                draft_seconds=policy._estimate(policy.draft_cost, k),
                verify_seconds=policy._estimate(policy.verify_cost, k),
            ),
        )
    policy._yield = realized


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
    p.draft_cost.update({8: 0.010})
    row = Row()
    feed(p, row, [7, 4, 7, 2, 6, 7] * 4)
    assert p.choose([row])[0] == [8]
    stuck = Row()  # a row whose sixth guess is always wrong: verifying beyond it costs and never pays
    feed(p, stuck, [5] * 24)
    assert p.choose([stuck])[0] == [6]


def test_each_row_gets_its_own_block_length():
    """A row the draft serves well drafts a block while the row beside it, which the draft serves badly, decodes
    plainly in the same forward."""
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({2: 0.030, 8: 0.034, 16: 0.040})
    p.draft_cost.update({8: 0.010, 16: 0.012})
    math, chat = Row(), Row()
    feed(p, math, [7, 6, 7, 5, 7, 6] * 4)
    feed(p, chat, [0] * 24)
    ks = p.choose([math, chat])[0]
    assert ks[0] >= 6 and ks[1] == 1
    padded = BlockPolicy(
        8, adaptive=True, ragged=False
    )  # a target that pads rows: the plain row would cost a block too
    padded.verify_cost.update({2: 0.030, 8: 0.034, 16: 0.060})
    padded.draft_cost.update({8: 0.010, 16: 0.012})
    assert padded.step_cost([8, 1]) == padded._estimate(padded.verify_cost, 16) + 0.010


def plain_steps(policy: BlockPolicy, rows: list, steps: int, seconds: float) -> None:
    for _ in range(steps):
        policy.observe(
            rows, StepRecord(ks=[1] * len(rows), accepted=[0] * len(rows), draft_seconds=0.0, verify_seconds=seconds)
        )


def test_a_draft_that_misses_decodes_plainly_and_probes_one_row_within_its_budget():
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({2: 0.030, 8: 0.032, 16: 0.040})
    p.draft_cost.update({8: 0.008, 16: 0.010})
    rows = [Row(), Row()]
    for r in rows:
        feed(p, r, [0] * 10)
    assert p.choose(rows)[0] == [1, 1]
    # Probing one row verifies 9 tokens and drafts one block: 0.041 s for an expected 2.03 tokens, which a plain step
    # commits at 0.015 s a token: an expected loss of 10.6 ms. 3 % of each row's share of the plain steps (15 ms)
    # covers it after 24 of them.
    plain_steps(p, rows, 23, 0.030)
    assert p.choose(rows)[0] == [1, 1]
    plain_steps(p, rows, 1, 0.030)
    assert p.choose(rows)[0] == [8, 1]
    for r in rows:  # rows that have shown for long they never accept are not probed again
        feed(p, r, [0] * 200)
    plain_steps(p, rows, 1000, 0.030)
    assert p.choose(rows)[0] == [1, 1]
    # A new request is measured at once, whatever the population says: it may be one the draft serves.
    assert p.choose([rows[0], Row()])[0] == [1, 8]


def test_a_row_near_break_even_is_probed_sooner_than_one_the_draft_never_serves():
    """A probe is paid for by its expected loss, not its gross cost: one that commits a few extra tokens costs less
    than one that commits none, so a row the draft serves a third of the time is re-measured sooner."""
    due = {}
    for history in ([0] * 12, [1, 0, 0] * 4):
        p = BlockPolicy(8, adaptive=True)
        p.verify_cost.update({1: 0.030, 2: 0.031, 4: 0.036, 8: 0.046})
        p.draft_cost.update({8: 0.010})
        row = Row()
        feed(p, row, history)
        assert p.choose([row])[0] == [1]
        due[history[0]] = next(n for n in range(1, 200) if plain_steps(p, [row], 1, 0.030) or p.choose([row])[0] != [1])
    assert due[1] < 0.7 * due[0], due


def test_a_probe_takes_the_block_that_could_pay_where_a_full_one_could_not():
    """Verifying 16 tokens costs three plain steps (one thread, AVX2): a full-block probe could never repay itself
    even at the draft card's acceptance, but 4 tokens could. After requests the draft did not serve, a new one is
    still measured, with the block that would serve it best were it as good as the card says."""
    p = BlockPolicy(16, adaptive=True, ceiling=conditional_for_tau(3.1, 16))
    p.verify_cost.update({1: 0.030, 2: 0.031, 4: 0.040, 8: 0.060, 16: 0.090})
    p.draft_cost.update({16: 0.009})
    feed(p, Row(), [0] * 20)
    row = Row()
    ks = p.choose([row])[0]
    assert p._probed is row and 1 < ks[0] < 16, ks


def test_a_new_request_is_probed_only_where_the_draft_at_its_known_best_could_pay():
    """A probe is priced with the acceptance the draft's card measured held out (3.5 tokens a block here, 0.74 a slot):
    at 2 rows it pays and a new request is measured at once; at 8 rows only a row far better than the draft has ever
    been could repay the probe, so the new request decodes plainly (credited 0.9 a slot, it would have been probed)."""

    def policy(**kw):
        p = BlockPolicy(8, adaptive=True, **kw)
        p.verify_cost.update({2: 0.030, 8: 0.040, 16: 0.046})
        p.draft_cost.update({8: 0.004})
        return p

    card = conditional_for_tau(3.5, 8)
    assert abs(BlockPolicy._tokens([card] * 7, 8) - 3.5) < 1e-6 and 0.73 < card < 0.75
    for p, probed_at_8 in ((policy(ceiling=card), False), (policy(), True)):
        old = [Row() for _ in range(7)]
        for r in old:  # the traffic so far: the draft never right
            feed(p, r, [0] * 20)
        assert p.choose([old[0], Row()])[0] == [1, 8]
        assert p.choose(old + [Row()])[0] == [1] * 7 + [8 if probed_at_8 else 1]


def test_drafting_steps_dearer_than_calibrated_are_learned():
    """Calibration times one-row forwards; a step whose rows draft also pays their context update and the per-row
    attention layout. Once drafting steps measure a third dearer than calibrated, a block that paid by a little no
    longer does, while plain steps keep their own estimate."""
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({2: 0.030, 8: 0.034, 16: 0.040})
    p.draft_cost.update({8: 0.018, 16: 0.020})
    math, chat = Row(), Row()
    feed(p, math, [2, 1, 3, 2] * 6)  # modest acceptance: a block pays (by about a sixth), but not by much
    feed(p, chat, [0] * 24)
    ks = p.choose([math, chat])[0]
    assert ks[0] > 1
    draft_s, verify_s = 1.35 * p._estimate(p.draft_cost, 8), 1.35 * p._estimate(p.verify_cost, sum(ks))
    for _ in range(40):
        p.observe([math, chat], StepRecord(ks=ks, accepted=[2, 0], draft_seconds=draft_s, verify_seconds=verify_s))
        plain_steps(p, [math, chat], 1, 0.030)
    assert p.factor[True] > 1.15 and abs(p.factor[False] - 1.0) < 0.05
    assert p.choose([math, chat])[0] == [1, 1]


def test_drafting_is_priced_like_plain_steps_until_a_drafting_step_is_measured():
    """Eight rows cost more than the one-row calibration forwards whether they draft or not: until a drafting step has
    been measured, one is priced with what plain steps taught (a factor left at 1.0 made a busy server's first
    steps draft every row), and from then on with its own."""
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({8: 0.020, 16: 0.024, 64: 0.048})
    p.draft_cost.update({8: 0.004, 64: 0.016})
    rows = [Row() for _ in range(8)]
    plain_steps(p, rows, 20, 0.040)  # 8 rows of one token: twice what one row of 8 tokens took
    assert p.factor[False] > 1.3
    drafting = [8] * 8
    assert p.step_cost(drafting) == p._curve(64, 8) * p.factor[False]
    p.observe(
        rows,
        StepRecord(ks=drafting, accepted=[0] * 8, draft_seconds=0.016, verify_seconds=p._estimate(p.verify_cost, 64)),
    )
    assert p.factor[True] is not None and p.step_cost(drafting) == p._curve(64, 8) * p.factor[True]


def test_no_probe_where_even_a_good_draft_could_not_pay():
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({t: 0.002 * t for t in (16, 32, 64, 128)})  # 16 rows, compute-bound: every token costs
    p.draft_cost.update({t: 0.001 * t for t in (32, 64, 128)})
    rows = [Row() for _ in range(16)]  # new rows, nothing measured: credited 0.9 per slot, 5.7 tokens a block
    assert p.choose(rows)[0] == [1] * 16
    plain_steps(p, rows, 1000, 0.032)
    assert p.choose(rows)[0] == [1] * 16


def test_sizes_not_chosen_follow_the_measured_ones():
    """Start-up costs are measured at an empty context; once contexts grow, the sizes the policy keeps choosing get
    dearer, and the others must too, or a shorter block would look cheaper than it is."""
    p = BlockPolicy(8, adaptive=True)
    for t, cost in ((1, 0.040), (2, 0.041), (4, 0.043), (8, 0.050)):
        p.record_cost(t, 0.010 if t == 8 else None, cost)
    for _ in range(200):  # full blocks at a long context: twice the start-up cost
        p.record_cost(8, 0.020, 0.100)
    assert abs(p.verify_cost[8] - 0.100) < 0.002 and abs(p.draft_cost[8] - 0.020) < 0.001
    assert abs(p._estimate(p.verify_cost, 4) - 0.086) < 0.002  # the calibrated ratio 43/50, at today's level
    assert abs(p.step_cost([4]) - (0.086 + 0.020)) < 0.003


def test_rows_that_accept_less_than_estimated_teach_the_policy_to_draft_less():
    """Rows chosen for their high estimates that then accept half of what was expected: the realized share is
    learned, and a block that paid on the estimate alone no longer does."""
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({2: 0.030, 8: 0.034, 16: 0.040})
    p.draft_cost.update({8: 0.018, 16: 0.020})
    math, chat = Row(), Row()
    feed(p, math, [2, 1, 3, 2] * 6)
    feed(p, chat, [0] * 24)
    ks = p.choose([math, chat])[0]
    assert ks[0] > 1 and p._probed is None
    for _ in range(60):  # the row keeps its counts (observed elsewhere) but this batch's drafts come in at half
        p.observe(
            [math, chat],
            StepRecord(
                ks=ks,
                accepted=[0, 0],
                draft_seconds=p._estimate(p.draft_cost, 8),
                verify_seconds=p._estimate(p.verify_cost, sum(ks)),
            ),
        )
        feed(p, math, [3, 3])  # keeps math's counts where they were (about 2 of its 7 accepted)
    assert p.realized < 0.6
    assert p.choose([math, chat])[0] == [1, 1]
    # Nothing drafts by choice now, so nothing measures the share: it fades back, and the row drafts again.
    plain_steps(p, [math, chat], 200, 0.030)
    ks = p.choose([math, chat])[0]
    assert p.realized > 0.9 and ks[0] > 1 and p._probed is None


def test_lookup_guesses_cost_no_draft_and_keep_their_own_record():
    """A row with lookup guesses verifies them without drafting (the step is priced as plain), its block is capped at
    its guesses, and what they yield is kept apart from the draft's record: lookups that fail do not teach the policy
    that the draft fails, and drafts that fail do not stop lookups that pay."""
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({1: 0.030, 2: 0.031, 4: 0.032, 8: 0.034})
    p.draft_cost.update({8: 0.030})  # drafting would double the step: only a row that accepts a lot drafts
    row = Row()
    feed(p, row, [0] * 24)  # the draft never serves this row
    assert p.choose([row])[0] == [1]
    ks, looked = p.choose([row], [5])
    assert 1 < ks[0] <= 6 and looked == [
        True
    ]  # at most its 5 guesses, priced with the prior until lookups are measured
    assert p.step_cost([6]) > p._cost(
        6, 0
    )  # as a drafting step it would be dearer: a lookup row is priced without the draft
    for _ in range(24):  # its lookups pay
        p.observe([row], StepRecord(ks=[6], accepted=[5], draft_seconds=0.0, verify_seconds=0.032, looked=[True]))
    assert p.choose([row], [5]) == ([6], [True])
    assert p._counts(row).accepted == [0.0] * 7  # the draft's record is untouched
    busy = BlockPolicy(8, adaptive=True)  # where every verified token costs compute (a large batch on a CPU)
    busy.verify_cost.update({1: 0.030, 2: 0.060, 4: 0.120, 8: 0.240})
    busy.draft_cost.update({8: 0.030})
    other = Row()
    for _ in range(24):  # this row's lookups never pay: a block of them is not worth its verify
        busy.observe([other], StepRecord(ks=[6], accepted=[0], draft_seconds=0.0, verify_seconds=0.180, looked=[True]))
    assert busy.choose([other], [5]) == ([1], [False])


def test_a_lookup_row_may_verify_beyond_the_drafts_block():
    """A loop, once matched, goes on: a lookup row's block is bounded by its guesses (lookup.MAX_GUESSES), not by the
    draft's block, and the policy takes a long block once that row's lookups have paid at every slot."""
    fixed = BlockPolicy(8)
    assert fixed.choose([Row()], [20]) == ([21], [True]) and fixed.choose([Row()], [0]) == ([8], [False])
    p = BlockPolicy(8, adaptive=True)
    p.verify_cost.update({1: 0.030, 8: 0.034, 16: 0.040, 32: 0.060})
    p.draft_cost.update({8: 0.030})
    row = Row()
    assert p.choose([row], [31])[0][0] < 32  # unmeasured lookups are priced with the prior: 32 tokens would not pay
    for _ in range(40):
        p.observe([row], StepRecord(ks=[32], accepted=[31], draft_seconds=0.0, verify_seconds=0.060, looked=[True]))
    ks, looked = p.choose([row], [31])
    assert ks[0] > 16 and looked == [True]
    assert p.lookup_population.accepted[30] == 40 and len(p.population.accepted) == 7


def test_a_row_held_at_short_blocks_learns_the_next_slot_from_its_spare_guess():
    """Requests before it have taught the population that the draft's second guess fails, so a row whose every first
    guess is right is held at k=2: verifying only its first guess, it never measures its second. The step's spare
    guess (the draft's guess one slot beyond the block, checked against the bonus token where every guess was
    accepted) measures it: a row whose spare guesses are right moves on to longer blocks, one without stays at 2."""
    chosen = {}
    for spare in (None, True):
        p = BlockPolicy(8, adaptive=True)
        p.verify_cost.update({1: 0.030, 2: 0.031, 4: 0.036, 8: 0.046})
        p.draft_cost.update({8: 0.008})
        chat = Row()
        feed(p, chat, [1, 0] * 12)  # first guess right half the time, second never
        row = Row()
        for _ in range(12):
            ks = p.choose([row])[0]
            realized = list(p._yield)
            p.observe(
                [row],
                StepRecord(
                    ks=ks,
                    accepted=[ks[0] - 1],
                    draft_seconds=0.008,
                    verify_seconds=p._estimate(p.verify_cost, ks[0]),
                    beyond=[spare if ks[0] > 1 else None],
                ),
            )
            p._yield = realized
        chosen[spare] = p.choose([row])[0][0]
    assert chosen[None] == 2 and chosen[True] > 2, chosen


def test_a_draft_trained_on_short_blocks_is_priced_by_the_slots_it_drafts():
    """A row whose first guess is right 45 % of the time, on a CPU where a block's second token is nearly free to
    verify: drafting all 8 slots for a 2-token block costs more than the guess brings, drafting its 3 (guess and
    spare, DraftConfig.short_blocks) less, and the policy drafts only where the draft is of the second kind."""
    chosen = {}
    for short in (False, True):
        p = BlockPolicy(8, adaptive=True, short=short)
        p.verify_cost.update({1: 0.0250, 2: 0.0255, 4: 0.0360, 8: 0.0550})
        p.draft_cost.update({2: 0.004, 4: 0.006, 8: 0.012})
        row = Row()
        feed(p, row, [0] * 11 + [1] * 5 + [2] * 4)
        assert p.step_cost([2]) == pytest.approx(0.0255 + (0.005 if short else 0.012))
        chosen[short] = p.choose([row])[0]
    assert chosen == {False: [1], True: [2]}
