"""Sampling is lossless in distribution: the tokens DFlash emits follow the target's exact distribution.

A tiny real Llama with an 8-token vocabulary makes the exact distribution enumerable; a reference
filter written here independently of trtllm_dflash.engine.sampling defines what "the target's distribution" is.
"""

import itertools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trtllm_dflash.config import DraftConfig, SamplingParams
from trtllm_dflash.engine.batch import Batch, speculative_stream
from trtllm_dflash.engine.request import GenerationStats, Request
from trtllm_dflash.engine.sampling import greedy
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.target import TargetModel

V, N_NEW, BLOCK, SAMPLES = 8, 4, 4, 2000  # token 1 from the prefill, tokens 2-3 drafted, token 4 bonus/resample
ROWS = 50  # sampled requests decoding side by side
PROMPT = [1, 5, 3]


@pytest.fixture(scope="module")
def tiny_target():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread sync dominates for a model this small
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.6,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    yield TargetModel(model, tokenizer=None, path=None)
    torch.set_num_threads(threads)


def make_draft(target, scale, seed):
    cfg = DraftConfig.for_target(target.text_config, vocab_rows=V, num_layers=1, block_size=BLOCK, mask_token_id=V - 1)
    draft = DFlashDraftModel(cfg)
    draft.init_weights(std=scale, generator=torch.Generator().manual_seed(seed))
    target.set_taps(cfg.target_layer_ids)
    return draft.eval()


def reference_probs(logits, sp):
    """Temperature, then keep the top_k largest, then the smallest prefix (by descending prob) reaching top_p."""
    p = torch.softmax(logits.double() / sp.temperature, -1)
    order = sorted(range(V), key=lambda i: -p[i].item())
    kept = order[: sp.top_k] if sp.top_k else order
    q = torch.zeros(V, dtype=torch.float64)
    q[kept] = p[kept]
    q /= q.sum()
    if sp.top_p < 1:
        mass, final = 0.0, []
        for i in kept:
            if mass >= sp.top_p:
                break
            final.append(i)
            mass += q[i].item()
        r = torch.zeros(V, dtype=torch.float64)
        r[final] = q[final]
        q = r / r.sum()
    return q


def exact_joint(target, sp, prompt=PROMPT):
    """P(x1..x4 | prompt) for all 8^4 sequences, from one batched forward over every 3-token prefix."""
    prefixes = list(itertools.product(range(V), repeat=N_NEW - 1))
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + list(x) for x in prefixes])).logits
    n = len(prompt)
    joint = {}
    for row, x in enumerate(prefixes):
        p = [reference_probs(logits[row, n - 1 + i], sp) for i in range(N_NEW)]
        for x4 in range(V):
            joint[(*x, x4)] = p[0][x[0]].item() * p[1][x[1]].item() * p[2][x[2]].item() * p[3][x4].item()
    return joint


def samples(target, draft, sp, prompt=PROMPT, stats=None, per=ROWS, neighbour=None):
    """SAMPLES continuations of `prompt`, each its own request with its own seed, `per` of them decoding side by side
    (a request alone takes the same step with one row; test_seed_reproducible runs it), after a greedy request for
    `neighbour`, at other positions, where one is given."""
    out = []
    for first in range(0, SAMPLES, per):
        batch = Batch(target, draft, BLOCK, slots=per + 1)
        rows = [
            Request(prompt, N_NEW, SamplingParams(sp.temperature, sp.top_p, sp.top_k, seed))
            for seed in range(first, first + per)
        ]
        got = {id(r): batch.add(r) for r in [*([Request(neighbour, 6)] if neighbour else []), *rows]}
        while batch.ready:
            for r, tokens in batch.step().items():
                got[id(r)] += tokens
            for r in [r for r in batch.rows if r.stats.finish_reason]:
                batch.remove(r)
        out += [tuple(got[id(r)]) for r in rows]
        if stats is not None:
            stats += [r.stats for r in rows]
    return out


def chi2_rejects(observed: list, expected: dict) -> bool:
    """Pearson chi-square at p < 1e-3 (Wilson-Hilferty critical value), pooling cells expected below 5."""
    counts = {}
    for o in observed:
        counts[o] = counts.get(o, 0) + 1
    if any(k not in expected or expected[k] == 0 for k in counts):
        return True  # produced something the target can never produce
    cells, pool_e, pool_o = [], 0.0, 0
    for k, p in expected.items():
        e = p * len(observed)
        if e < 5:
            pool_e, pool_o = pool_e + e, pool_o + counts.get(k, 0)
        else:
            cells.append((counts.get(k, 0), e))
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    dof = len(cells) - 1
    if dof < 1:
        return False  # a single possible outcome, and nothing outside it was produced
    stat = sum((o - e) ** 2 / e for o, e in cells)
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    return stat > crit


def statistics(seqs, joint):
    """Per-position marginals and the pairs spanning the drafted slots: (observed, exact) for each."""
    views = [(i,) for i in range(N_NEW)] + [(1, 2), (2, 3)]
    out = []
    for idx in views:
        exact = {}
        for k, p in joint.items():
            key = tuple(k[i] for i in idx)
            exact[key] = exact.get(key, 0.0) + p
        out.append(([tuple(s[i] for i in idx) for s in seqs], exact))
    return out


def assert_matches(seqs, joint):
    for observed, exact in statistics(seqs, joint):
        assert not chi2_rejects(observed, exact)


@pytest.mark.parametrize(
    "sp",
    [SamplingParams(1.0), SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_p=0.7)],
    ids=["t1", "t1-topk3", "t0.8-topp0.7"],
)
def test_distribution_matches_target(tiny_target, sp):
    draft = make_draft(tiny_target, scale=0.3, seed=1)
    assert_matches(samples(tiny_target, draft, sp), exact_joint(tiny_target, sp))


def test_distribution_matches_target_under_batching(tiny_target):
    sp = SamplingParams(1.0, top_k=3)
    draft = make_draft(tiny_target, scale=0.3, seed=1)
    # ten sampled requests a batch, beside a greedy neighbour at other positions that joined first
    assert_matches(
        samples(tiny_target, draft, sp, per=10, neighbour=[1, 5, 3, 2, 6, 4, 7, 2]), exact_joint(tiny_target, sp)
    )


def test_lookup_guesses_keep_sampling_exact(tiny_target, monkeypatch):
    """Lookup guesses (lookup.py) are drafts with all their mass on one token: accepted with the target's probability
    of it, resampled without it. Matching single tokens against a prompt that holds every token makes them come at
    most steps."""
    import trtllm_dflash.engine.lookup as lookup

    monkeypatch.setattr(lookup, "MIN_NGRAM", 1)
    prompt, sp, stats = [1, 5, 3, 2, 6, 4, 0, 7, 1, 5], SamplingParams(1.0), []
    draft = make_draft(tiny_target, scale=0.3, seed=1)
    assert_matches(samples(tiny_target, draft, sp, prompt, stats), exact_joint(tiny_target, sp, prompt))
    assert sum(s.lookup_steps for s in stats) > SAMPLES and sum(s.lookup_accepted for s in stats) > SAMPLES // 4


def test_bad_draft_is_still_exact(tiny_target):
    """A draft peaked on arbitrary tokens gets rejected often; the output distribution must not move."""
    sp = SamplingParams(1.0)
    draft = make_draft(tiny_target, scale=3.0, seed=7)
    assert_matches(samples(tiny_target, draft, sp), exact_joint(tiny_target, sp))


def test_detector_has_power(tiny_target):
    """The same test rejects a sampler that is slightly off (temperature 1.15 instead of 1.0)."""
    draft = make_draft(tiny_target, scale=0.3, seed=1)
    seqs = samples(tiny_target, draft, SamplingParams(1.15))
    joint = exact_joint(tiny_target, SamplingParams(1.0))
    assert any(chi2_rejects(observed, exact) for observed, exact in statistics(seqs, joint))


def test_seed_reproducible(tiny_target):
    draft = make_draft(tiny_target, scale=0.3, seed=1)
    runs = []
    for _ in range(2):
        stats = GenerationStats()
        runs.append(
            [
                t
                for s in speculative_stream(
                    tiny_target, draft, PROMPT, 12, BLOCK, SamplingParams(1.0, seed=42), frozenset(), stats
                )
                for t in s
            ]
        )
    assert runs[0] == runs[1]


def test_greedy_picks_the_first_maximum_in_every_dtype():
    """The fp32 detour for half-precision logits keeps argmax's ids, ties (first maximum) included."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (16, 5000), generator=gen).float()  # many exact ties per row
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        assert torch.equal(greedy(x), x.argmax(-1)), dtype
        assert torch.equal(greedy(x), (x == x.max(-1, keepdim=True).values).int().argmax(-1)), dtype  # first max


def test_a_draft_vocabulary_keeps_the_distribution_exact(tiny_target):
    """A draft that may guess only 3 of the 8 tokens (models/draft_vocab.py): q is zero elsewhere, the output
    distribution must not move."""
    sp = SamplingParams(1.0)
    draft = make_draft(tiny_target, scale=0.3, seed=1)
    draft.use_vocab(torch.tensor([0, 2, 5]), tiny_target.lm_head)
    logits = draft.compute_logits(torch.randn(1, 2, 32), tiny_target.lm_head)
    assert torch.isinf(logits[..., [1, 3, 4, 6, 7]]).all() and torch.isfinite(logits[..., [0, 2, 5]]).all()
    assert_matches(samples(tiny_target, draft, sp), exact_joint(tiny_target, sp))
