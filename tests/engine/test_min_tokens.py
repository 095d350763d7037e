"""min_tokens (the ensemble input) against Hugging Face generate(min_new_tokens=...) on the real SmolLM2-135M.

Holding back the stop tokens changes the target's distribution; the draft proposes and the target
verifies against that changed distribution, so greedy output stays token-identical to HF's.
"""

import pytest
import torch

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.models.checkpoint import load_draft

PROMPT = "Hi"  # the chat model answers in a few tokens and ends on EOS


@pytest.fixture(scope="module")
def draft(target, random_draft_dir):
    model = load_draft(random_draft_dir)
    target.set_taps(model.config.target_layer_ids)
    return model


@pytest.fixture(scope="module")
def case(target):
    engine = DFlashEngine(target, None, 1)
    ids = engine.encode(PROMPT)
    eos = sorted(engine.eos_token_ids)
    natural = engine.generate(PROMPT, max_new_tokens=64).token_ids
    assert natural[-1] in eos, "the prompt should end on EOS by itself"
    min_tokens, max_new = len(natural) + 4, len(natural) + 16
    out = target.model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new,
        min_new_tokens=min_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=target.tokenizer.pad_token_id,
    )
    return ids, eos, min_tokens, max_new, out[0, len(ids) :].tolist()


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_min_tokens_equals_hf_min_new_tokens(target, draft, case, block_size):
    ids, eos, min_tokens, max_new, ref = case
    engine = DFlashEngine(target, draft if block_size > 1 else None, block_size)
    got = [t for new, _ in engine.stream(ids, max_new_tokens=max_new, min_tokens=min_tokens) for t in new]
    assert got == ref
    assert not set(got[:min_tokens]) & set(eos)


def test_sampled_min_tokens_holds_back_eos(target, draft, case):
    ids, eos, min_tokens, max_new, _ = case
    engine = DFlashEngine(target, draft, 4)
    for seed in range(2):
        stats = GenerationStats()
        got = [
            t
            for new, _ in engine.stream(
                ids,
                max_new_tokens=max_new,
                min_tokens=min_tokens,
                stats=stats,
                sampling=SamplingParams(1.0, 1.0, 0, seed),
            )
            for t in new
        ]
        assert len(got) >= min_tokens and not set(got[:min_tokens]) & set(eos)
