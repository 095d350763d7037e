"""The step's phases alone (accept, lookup's propose) and its one record: what the request statistics, the engine's
metrics and the policy read of a step is the `StepRecord` the step left, on the real SmolLM2 target and the shipped
draft."""

import torch

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.batch import Batch
from trtllm_dflash.engine.propose import LookupProposer
from trtllm_dflash.engine.request import Request
from trtllm_dflash.engine.scheduler import EngineMetrics
from trtllm_dflash.engine.step import RowPlan, accept
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.resolve import DRAFTS_DIR

VOCAB = 16


def logits_with_argmax(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), tokens] = 5.0
    return logits


def test_greedy_accept_takes_the_prefix_the_target_agrees_with_then_its_next_token():
    target_says = [5, 7, 9, 2]
    for guesses, accepted, bonus in (([5, 7, 4], 2, 9), ([5, 7, 9], 3, 2), ([1, 7, 9], 0, 5)):
        plan = RowPlan(Request([0], 8), k=4, guesses=list(guesses))
        logits = logits_with_argmax(target_says)
        accept(plan, logits, logits.argmax(-1))
        assert (plan.accepted, plan.bonus) == (accepted, bonus)
        assert plan.beyond is None  # no spare guess was drafted


def test_the_spare_guess_is_judged_only_where_every_verified_guess_was_accepted():
    for guesses, spare, beyond in (([5], 7, True), ([5], 8, False), ([4], 7, None)):
        plan = RowPlan(Request([0], 8), k=2, guesses=list(guesses), spare_guess=spare)
        logits = logits_with_argmax([5, 7])
        accept(plan, logits, logits.argmax(-1))
        assert plan.beyond is beyond


def test_lookup_verifies_as_many_candidates_as_its_block_holds_and_a_sampled_row_gets_their_point_mass():
    greedy_plan = RowPlan(Request([0], 8), k=3, looked=True, found=[4, 5, 6, 7])
    sampled_plan = RowPlan(Request([0], 8, SamplingParams(temperature=0.7, seed=1)), k=4, looked=True, found=[4, 5, 6])
    drafting_plan = RowPlan(Request([0], 8), k=3)
    assert LookupProposer(max_guesses=8, vocab_rows=VOCAB).propose([greedy_plan, sampled_plan, drafting_plan]) == 0
    assert greedy_plan.guesses == [4, 5] and greedy_plan.q is None
    assert sampled_plan.guesses == [4, 5, 6]
    assert torch.equal(sampled_plan.q, torch.nn.functional.one_hot(torch.tensor([4, 5, 6]), VOCAB).float())
    assert drafting_plan.guesses == []  # the draft's row, left to the draft


def test_the_step_record_is_what_the_requests_the_metrics_and_the_policy_see(target):
    draft = load_draft(DRAFTS_DIR / "smollm2-135m")
    target.set_taps(draft.config.target_layer_ids)
    batch = Batch(target, draft, draft.config.block_size, slots=3)
    seen = []
    observe = batch.policy.observe
    batch.policy.observe = lambda rows, step: (seen.append(step), observe(rows, step))
    prompts = ["The capital of France is", "def fib(n):", "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3"]
    reqs = [Request(target.tokenizer.encode(p), 24, stop_token_ids=frozenset()) for p in prompts]
    for r in reqs:
        while not batch.add(r):
            pass
    records, metrics, committed = [], EngineMetrics(), {r: 1 for r in reqs}
    while batch.ready:
        rows = batch.ready
        out = batch.step()
        records.append((rows, batch.last_step))
        metrics.add_step(batch.last_step)
        for r in rows:
            committed[r] += len(out[r])
    assert [step for _, step in records] == seen  # the policy learned from the very record the step left
    for r in reqs:
        mine = [(step, rows.index(r)) for rows, step in records if r in rows]
        assert r.stats.steps == len(mine)
        assert r.stats.drafted_tokens == sum(step.ks[i] - 1 for step, i in mine)
        assert r.stats.accepted_tokens == sum(step.accepted[i] for step, i in mine)
        assert r.stats.lookup_steps == sum(step.looked[i] for step, i in mine)
        assert r.stats.num_tokens == committed[r] == 1 + sum(step.committed[i] for step, i in mine)
    assert metrics.steps == len(records) and metrics.row_steps == sum(r.stats.steps for r in reqs)
    assert metrics.drafted_tokens == sum(r.stats.drafted_tokens for r in reqs) > 0
    assert metrics.accepted_tokens == sum(r.stats.accepted_tokens for r in reqs) > 0
    assert metrics.lookup_steps == sum(r.stats.lookup_steps for r in reqs) > 0  # the counting prompt repeats
    assert metrics.generated_tokens == sum(r.stats.num_tokens - 1 for r in reqs)


def test_every_published_metric_is_a_field_or_property_of_the_engine_metrics():
    published = EngineMetrics.published()
    m = EngineMetrics()
    assert {kind for kind, _ in published.values()} == {"gauge", "counter"}
    assert all(isinstance(getattr(m, name), (int, float)) and help for name, (_, help) in published.items())
    assert "acceptance_length" in published and "row_steps" not in published
