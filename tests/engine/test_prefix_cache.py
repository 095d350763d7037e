"""Prefix caching (prefix_cache.py): prompts that start the same way reuse the K/V and draft features of their common
chunks, and a prompt's cache holds the same bits copied or computed, so what a request writes never depends on what
ran before it. On the real SmolLM2-135M target with the shipped draft."""

import pytest
import torch
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.engine.batch import Batch
from trtllm_dflash.engine.prefix_cache import BLOCK, Entry, PrefixCache, chunk_ends, chunk_keys
from trtllm_dflash.engine.request import GenerationStats, Request
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import DRAFTS_DIR

STORY = (
    "Mara kept a small bakery at the end of Willow Street. Every morning at five she lit the oven, "
    "kneaded the rye dough her grandmother had taught her to make, and set out the loaves to cool by the window. "
    "On Tuesdays she baked cinnamon rolls for the school across the road, and on Fridays the fishermen came "
    "for her seeded bread before they went out to sea. One winter the oven broke, and the whole street "
    "brought wood, bricks and tools until it was built again. "
)
QUESTIONS = ("What did Mara bake on Tuesdays?", "Who helped when the oven broke?")


def _engine(dtype: torch.dtype, target_dir) -> DFlashEngine:
    target = TargetModel.load(target_dir, dtype)
    draft = load_draft(DRAFTS_DIR / "smollm2-135m", dtype)
    draft.pack()
    target.set_taps(draft.config.target_layer_ids)
    return DFlashEngine(target, draft, draft.config.block_size, speculation="fixed")


def _run(batch: Batch, ids: list[int], max_new: int):
    """One request through `batch`; its tokens, its slot's K/V and staged draft features over the prompt as they were
    right after its prefill, and its statistics."""
    req = Request(ids, max_new)
    while not (out := batch.add(req)):
        pass
    kv = batch.cache.read(batch.rows.index(req), 0, len(ids))
    feats = req.features.tensor().clone()  # none taken into the draft's context yet
    while not req.stats.finish_reason:
        out += batch.step()[req]
    batch.remove(req)
    return out, kv, feats, req.stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_sharing_a_document_reuse_its_chunks_and_write_what_a_cold_prefill_writes(target_dir, dtype):
    if dtype == torch.bfloat16 and bf16_gemm.variant() is None:
        pytest.skip("bf16 bits are exact only on our bf16 kernels (AVX-512 BF16 or AVX2 alone)")
    engine = _engine(dtype, target_dir)
    a, b = (engine.encode(STORY * 2 + q) for q in QUESTIONS)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    head = len(engine.prefix)
    assert head > 10 and common - head >= 2 * BLOCK
    warm = Batch(engine.target, engine.draft, engine.block_size, slots=2, prefix=engine.prefix, cache_tokens=4096)
    _run(warm, a, 8)
    out, kv, feats, stats = _run(warm, b, 24)
    assert stats.cached_tokens == head + (common - head) // BLOCK * BLOCK  # every whole chunk the prompts share
    cold = Batch(
        engine.target, engine.draft, engine.block_size, slots=1, prefix=engine.prefix
    )  # the head only, as the CLI
    cold_out, cold_kv, cold_feats, cold_stats = _run(cold, b, 24)
    assert cold_stats.cached_tokens == 0 and out == cold_out
    assert all(torch.equal(x, y) for x, y in zip(kv[0] + kv[1], cold_kv[0] + cold_kv[1])), (
        "K/V bits differ copied vs computed"
    )
    assert torch.equal(feats, cold_feats)
    # and it is plain decoding's text (Hugging Face's generate() parts from both at a near-tie on this prompt: its
    # incremental decode picks the second of logits 0.04 apart, its own forward over the whole text the first)
    plain = DFlashEngine(engine.target, None, 1)
    assert out == [t for step, _ in plain.stream(b, max_new_tokens=24) for t in step]


def test_a_served_conversation_reuses_each_turns_prompt_and_streams_what_the_cli_streams(target_dir):
    """Three turns through the server's engine loop, each resent whole with the answer before it: turn 3 copies the
    chunks of turn 2's prompt, the metrics count them, and its text is what one request alone (the CLI's path) writes."""
    engine = _engine(torch.float32, target_dir)
    engine.policy.adaptive = False
    scheduler = engine.scheduler(2, 1024, prefix_cache_tokens=4096)
    try:
        turns, messages = [], []
        for question in (STORY + QUESTIONS[0], QUESTIONS[1], "Write one sentence about the street."):
            messages.append({"role": "user", "content": question})
            # as the OpenAI front end sends it: the conversation rendered whole, then encoded as text
            ids = engine.encode(
                engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), chat=False
            )
            stats, tokens = GenerationStats(), []
            for step, _ in engine.stream(ids, max_new_tokens=48, stats=stats, scheduler=scheduler):
                tokens += step
            turns.append((ids, tokens, stats.cached_tokens))
            messages.append({"role": "assistant", "content": engine.tokenizer.decode(tokens, skip_special_tokens=True)})
        head = len(engine.prefix)
        for (before, _, _), (ids, _, cached) in zip(turns, turns[1:]):  # the whole chunks the turns share
            common = next((i for i, (x, y) in enumerate(zip(before, ids)) if x != y), len(before))
            assert cached == head + (common - head) // BLOCK * BLOCK
        assert turns[0][2] == 0 and turns[2][2] > turns[1][2] >= head + BLOCK  # the first computed the head
        assert scheduler.metrics.cached_prompt_tokens == sum(c for _, _, c in turns)
        ids, tokens, _ = turns[2]
        alone = [t for step, _ in engine.stream(ids, max_new_tokens=48) for t in step]
        assert tokens == alone
    finally:
        scheduler.stop()


def test_the_cache_keeps_the_most_recently_used_chunks_within_its_budget():
    def entry(tokens):
        return Entry([torch.zeros(3, tokens, 4)], [torch.zeros(3, tokens, 4)], None)

    heard = []  # what a listener (a Dynamo worker's KV events) is told, in order

    class Listener:
        def stored(self, key, prompt, start, end):
            heard.append(("stored", key, start, end))

        def removed(self, key):
            heard.append(("removed", key))

    prompt = list(range(24 + 3 * BLOCK))
    cache = PrefixCache(2 * BLOCK, Listener())
    cache.put(b"head", entry(24), pin=True, prompt=prompt, end=24)  # pinned: outside the budget, never evicted
    cache.put(b"a", entry(BLOCK), prompt=prompt, end=24 + BLOCK)
    cache.put(b"b", entry(BLOCK), prompt=prompt, end=24 + 2 * BLOCK)
    assert cache.get(b"a") is not None  # now the most recently used
    cache.put(b"c", entry(BLOCK), prompt=prompt, end=24 + 3 * BLOCK)
    assert b"b" not in cache and b"a" in cache and b"c" in cache and b"head" in cache
    assert cache.tokens == 2 * BLOCK
    cache.put(b"big", entry(3 * BLOCK))  # larger than the whole budget: not kept, nothing evicted for it
    assert b"big" not in cache and cache.tokens == 2 * BLOCK
    cache.put(b"a", entry(BLOCK), prompt=prompt, end=24 + BLOCK)  # held already: nothing to tell
    assert heard == [
        ("stored", b"head", 0, 24),
        ("stored", b"a", 24, 24 + BLOCK),
        ("stored", b"b", 24 + BLOCK, 24 + 2 * BLOCK),
        ("removed", b"b"),  # evicted before what replaced it is stored
        ("stored", b"c", 24 + 2 * BLOCK, 24 + 3 * BLOCK),
    ]
    assert PrefixCache(0).put(b"x", entry(BLOCK)) is None and b"x" not in PrefixCache(0)


def test_chunks_and_their_keys():
    assert (
        chunk_ends(24, 24) == [24]
        and chunk_ends(200, 24) == [24, 88, 152, 200]
        and chunk_ends(130, 0) == [64, 128, 130]
    )
    a, b = list(range(300)), list(range(300))
    b[100] = -1
    ka, kb = chunk_keys(a, chunk_ends(300, 24)), chunk_keys(b, chunk_ends(300, 24))
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))  # a key commits to every token before it
    assert chunk_keys(a[:152], chunk_ends(152, 24)) == ka[:3]


def test_build_plans_the_prefix_cache_and_rejects_a_negative_budget(tmp_path):
    r = CliRunner().invoke(main, ["build", "--output", str(tmp_path / "b"), "--prefix-cache-tokens", "-1", "--dry-run"])
    assert r.exit_code != 0 and "--prefix-cache-tokens must be 0 (off) or more, got -1." in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(
        main, ["build", "--output", str(tmp_path / "b"), "--prefix-cache-tokens", "4096", "--dry-run"]
    )
    assert r.exit_code == 0 and "prefix cache" in r.output and "(4096 tokens)" in r.output
