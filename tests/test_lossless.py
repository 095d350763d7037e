"""Greedy DFlash output equals the target's own greedy decoding, token for token, on the real SmolLM2-135M."""

import pytest
import torch

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.batch import speculative_stream
from trtllm_dflash.engine.policy import BlockPolicy
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.models.checkpoint import load_draft

PROMPTS = [
    ("Write a Python function that checks whether a number is prime.", True),
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
        True,
    ),
    ("The capital of France is", False),
]
MAX_NEW = 32  # two blocks of 16: every block size below crops and carries over at least once


@pytest.fixture(scope="module")
def references(target):
    """The target's own HF generate() greedy output per prompt: the ground truth."""
    engine = DFlashEngine(target, None, 1)
    refs = {}
    for prompt, chat in PROMPTS:
        ids = engine.encode(prompt, chat)
        out = target.model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=target.tokenizer.pad_token_id,
        )
        refs[prompt] = (ids, out[0, len(ids) :].tolist())
    return refs


@pytest.fixture(scope="module")
def draft(target, random_draft_dir):
    model = load_draft(random_draft_dir)
    target.set_taps(model.config.target_layer_ids)
    return model


class OracleDraft(torch.nn.Module):
    """A test double wrapping a real draft: it proposes the target's own continuation, wrong at a few slots.

    The real draft still computes context K/V and its block forward (so caches and positions are
    exercised); only the logits are replaced, so acceptance runs are long and cropping is frequent. With no
    `sequence` the real draft's own logits pass through (it only records what was drafted).
    """

    def __init__(self, draft, sequence, wrong_every=5):
        super().__init__()
        self.inner, self.config, self.sequence, self.wrong_every = draft, draft.config, sequence, wrong_every
        self.calls = 0

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def draft_block(self, noise, positions, ctx_k, ctx_v, ctx_lens):
        self.positions = positions[0, 1:].tolist()
        self.calls, self.width = self.calls + 1, positions.shape[1]
        return self.inner.draft_block(noise, positions, ctx_k, ctx_v, ctx_lens)

    vocab_token_ids = None  # its logits cover the whole vocabulary

    def to_full_vocab(self, logits):
        return logits

    def compute_logits(
        self, hidden, lm_head, full=True
    ):  # hidden [1, k-1, H]: one request (the block drafted may be longer)
        if self.sequence is None:  # the real draft's own guesses
            return self.inner.compute_logits(hidden, lm_head, full)
        logits = torch.zeros(*hidden.shape[:2], lm_head.weight.shape[0])
        for j, pos in enumerate(self.positions[: hidden.shape[1]]):
            tok = self.sequence[pos] if pos < len(self.sequence) else 0
            if (self.calls + j) % self.wrong_every == self.wrong_every - 1:
                tok = (tok + 1) % logits.shape[-1]
            logits[0, j, tok] = 1.0
        return logits


def run(target, draft, ids, block_size):
    stats = GenerationStats()
    out = [
        t
        for step in speculative_stream(target, draft, ids, MAX_NEW, block_size, SamplingParams(), frozenset({2}), stats)
        for t in step
    ]
    return out, stats


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_random_draft_is_lossless(target, draft, references, block_size):
    for prompt, _ in PROMPTS:
        ids, ref = references[prompt]
        out, stats = run(target, draft, ids, block_size)
        assert out == ref, prompt
        assert stats.steps >= 1


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_oracle_draft_long_acceptances_are_lossless(target, draft, references, block_size):
    for prompt, _ in PROMPTS:
        ids, ref = references[prompt]
        oracle = OracleDraft(draft, ids + ref)
        out, stats = run(target, oracle, ids, block_size)
        assert out == ref, prompt
        if len(ref) >= 2 * block_size:
            assert stats.acceptance_length > 1.5  # long accepted runs really happened
            assert stats.accepted_tokens < stats.drafted_tokens  # and so did rejections


class VerifiesOneGuess(BlockPolicy):
    """An adaptive policy held at k=2 that records what each step tells it: (k, accepted, the oracle's call, beyond)."""

    def __init__(self, block_size, oracle):
        super().__init__(block_size, adaptive=True)
        self.oracle, self.seen = oracle, []

    def choose(self, rows, lookup=None):
        return [min(2, max(r.remaining, 1)) for r in rows], [False] * len(rows)

    def observe(self, rows, step):
        self.seen.append((step.ks[0], step.accepted[0], self.oracle.calls, step.beyond[0]))
        super().observe(rows, step)


def test_a_step_checks_the_drafts_guess_one_slot_beyond_its_block(target, draft, references):
    """The draft computes its whole block, so a step that verifies one guess also takes the next one (not verified,
    not committed): where the verified guess is accepted, the bonus token says whether that spare guess was right,
    and the policy counts it as the second slot's. The oracle's guesses are wrong exactly where its pattern says."""
    prompt = PROMPTS[1][0]
    ids, ref = references[prompt]
    oracle = OracleDraft(draft, ids + ref, wrong_every=3)
    policy = VerifiesOneGuess(16, oracle)
    stats = GenerationStats()
    out = [
        t
        for s in speculative_stream(
            target, oracle, ids, MAX_NEW, 16, SamplingParams(), frozenset({2}), stats, policy=policy, lookup=False
        )
        for t in s
    ]
    assert out == ref
    known = 0
    for k, accepted, call, beyond in policy.seen:
        first_right, spare_right = (
            call % 3 != 2,
            (call + 1) % 3 != 2,
        )  # the oracle's guess j is wrong at (calls + j) % 3 == 2
        assert accepted == (first_right if k == 2 else 0)
        assert beyond == (spare_right if k == 2 and first_right else None)
        known += beyond is not None
    assert 0 < known < len(policy.seen)
    assert policy.population.reached[1] == known and policy.population.accepted[1] == sum(
        b is True for *_, b in policy.seen
    )


class CyclesBlocks(BlockPolicy):
    """An adaptive policy whose blocks cycle through 2..max_block, recording (block, slots the draft drafted)."""

    def __init__(self, block_size, draft, short):
        super().__init__(block_size, adaptive=True, short=short)
        self.draft, self.seen = draft, []

    def choose(self, rows, lookup=None):
        k = 2 + len(self.seen) % (self.max_block - 1)
        return [min(k, max(r.remaining, 1)) for r in rows], [False] * len(rows)

    def observe(self, rows, step):
        self.seen.append((step.ks[0], self.draft.width if step.ks[0] > 1 else None))
        super().observe(rows, step)


@pytest.mark.parametrize("short", [False, True])
def test_a_draft_trained_on_short_blocks_drafts_only_the_slots_a_block_needs(
    target, random_draft_dir, references, short
):
    """With a draft trained on short blocks (its config's dflash_config.short_blocks) a block of k tokens is drafted
    over k + 1 slots (its guesses and the spare), else over the whole block; the output is the target's either way,
    from the oracle's long accepted runs and from the draft's own guesses."""
    model = load_draft(random_draft_dir)
    if short:
        model.config.extra["dflash_config"]["short_blocks"] = 0.5
    prompt = PROMPTS[0][0]
    ids, ref = references[prompt]
    for sequence in (ids + ref, None):
        oracle = OracleDraft(model, sequence)
        policy = CyclesBlocks(8, oracle, short=model.config.short_blocks > 0)
        stats = GenerationStats()
        out = [
            t
            for s in speculative_stream(
                target, oracle, ids, MAX_NEW, 8, SamplingParams(), frozenset({2}), stats, policy=policy, lookup=False
            )
            for t in s
        ]
        assert out == ref
        drafted = [(k, w) for k, w in policy.seen if k > 1]  # the last step may be plain (one token left)
        assert {w for _, w in drafted} == ({min(8, k + 1) for k in range(2, 9)} if short else {8})
        assert all(w == (min(8, k + 1) if short else 8) for k, w in drafted)


def test_autoregressive_baseline_matches_hf(target, references):
    engine = DFlashEngine(target, None, 1)
    for prompt, chat in PROMPTS:
        ids, ref = references[prompt]
        result = engine.generate(prompt, chat=chat, max_new_tokens=MAX_NEW)
        assert result.token_ids == ref
        assert result.stats.acceptance_length == 1.0


def test_stats_and_text(target, draft, references):
    engine = DFlashEngine(target, draft, 16)
    prompt = PROMPTS[0][0]
    ids, ref = references[prompt]
    result = engine.generate(prompt, max_new_tokens=MAX_NEW)
    assert result.token_ids == ref
    assert result.text == target.tokenizer.decode(ref, skip_special_tokens=True)
    s = result.stats
    assert s.num_tokens == len(ref) and s.prompt_tokens == len(ids)
    assert s.acceptance_length == pytest.approx((len(ref) - 1) / s.steps)
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert s.tokens_per_second > 0 and s.finish_reason in ("stop", "length")


def test_stop_token_and_max_tokens_never_overshoot(target, draft, references):
    prompt = PROMPTS[1][0]
    ids, ref = references[prompt]
    oracle = OracleDraft(draft, ids + ref, wrong_every=1000)  # accepts whole blocks
    stop = ref[10]
    first = ref.index(stop)
    stats = GenerationStats()
    out = [
        t
        for s in speculative_stream(target, oracle, ids, MAX_NEW, 16, SamplingParams(), frozenset({stop}), stats)
        for t in s
    ]
    assert out == ref[: first + 1] and stats.finish_reason == "stop"
    for n in (1, 5, 17):
        stats = GenerationStats()
        out = [
            t for s in speculative_stream(target, oracle, ids, n, 16, SamplingParams(), frozenset(), stats) for t in s
        ]
        assert out == ref[:n] and stats.finish_reason == "length"


def test_mask_token_in_output_is_not_a_stop(target, draft, references):
    """Only committed tokens are scanned for stops, so a stop id equal to mask_token_id does not misfire."""
    ids, ref = references[PROMPTS[0][0]]
    stats = GenerationStats()
    stops = frozenset({draft.config.mask_token_id, 2})
    out = [t for s in speculative_stream(target, draft, ids, MAX_NEW, 16, SamplingParams(), stops, stats) for t in s]
    assert out == ref


def test_stop_strings_end_text(target):
    engine = DFlashEngine(target, None, 1)
    full = engine.generate(PROMPTS[0][0], max_new_tokens=MAX_NEW)
    cut = full.text[20:24]
    stopped = engine.generate(PROMPTS[0][0], max_new_tokens=MAX_NEW, stop_strings=(cut,))
    assert stopped.text == full.text[: full.text.index(cut)]
    assert stopped.stats.finish_reason == "stop"


def test_lookup_guesses_are_lossless_where_the_text_loops(target, draft):
    """SmolLM2 answers this question by looping on a sentence, so for many steps the verified guesses are lookup's
    (lookup.py), beside the draft's elsewhere: the output is still the target's own, and lookup really ran."""
    prompt, n = "What are three simple habits that help people sleep better?", 96
    ids = DFlashEngine(target, None, 1).encode(prompt, True)
    ref = target.model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=[2],
        pad_token_id=target.tokenizer.pad_token_id,
    )[0, len(ids) :].tolist()
    for lookup in (True, False):
        stats = GenerationStats()
        out = [
            t
            for s in speculative_stream(
                target, draft, ids, n, 8, SamplingParams(), frozenset({2}), stats, lookup=lookup
            )
            for t in s
        ]
        assert out == ref
        assert (stats.lookup_steps >= 3 and stats.lookup_accepted >= 10) if lookup else stats.lookup_steps == 0
        assert (max(stats.block_lengths) > 8) == lookup  # lookup guesses beyond the draft's block were verified
