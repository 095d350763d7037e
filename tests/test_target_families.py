"""The target adapter works across HF families: taps, cache cropping and verification stay lossless."""

import pytest
import torch
import transformers

from trtllm_dflash.config import DraftConfig, SamplingParams
from trtllm_dflash.engine.batch import speculative_stream
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.target import TargetModel

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {"sliding_window": 4}),
    "gpt_oss": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4, "layer_types": None},
    ),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # small models: thread sync would dominate


@pytest.mark.parametrize("family", FAMILIES)
def test_family_greedy_lossless(family):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**COMMON, **extra, initializer_range=0.5)
    target = TargetModel(model_cls(config).eval().requires_grad_(False), tokenizer=None, path=None)
    cfg = DraftConfig.for_target(
        target.text_config, vocab_rows=target.vocab_rows, num_layers=2, block_size=4, mask_token_id=63
    )
    draft = DFlashDraftModel(cfg)
    draft.init_weights(generator=torch.Generator().manual_seed(1))
    target.set_taps(cfg.target_layer_ids)
    prompt = [3, 17, 9, 40, 22, 5, 11, 30, 2, 8]
    hf = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ref = hf[0, len(prompt) :].tolist()
    for block in (1, 4):
        stats = GenerationStats()
        out = [
            t
            for s in speculative_stream(
                target, draft if block > 1 else None, prompt, 24, block, SamplingParams(), frozenset(), stats
            )
            for t in s
        ]
        assert out == ref, (family, block)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_lean_forward_computes_what_the_hf_forward_does(family):
    """The lean layer loop against the model's own HF forward, in fp32: a prefill, a one-token decode, a block verify
    and ragged rows on the flat axis give the same logits and tapped features, and write the same K/V. Fusing the
    projections (which the lean loop runs) leaves what the HF forward computes as it was."""
    import copy

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**COMMON, **extra, initializer_range=0.5, attention_bias=family == "qwen2")
    model = model_cls(config).eval().requires_grad_(False)
    untouched = copy.deepcopy(model)
    target = TargetModel(model, tokenizer=None, path=None)
    assert target.lean and hasattr(target.layers[0].self_attn, "qkv_proj"), family
    ids = torch.tensor([[3, 17, 9, 40, 22, 5, 11, 12, 6, 1]])
    torch.testing.assert_close(target.model(ids).logits, untouched(ids).logits, rtol=1e-5, atol=1e-5)
    target.set_taps([1, 4])
    prompts = [[3, 17, 9, 40, 22, 5, 11], [8, 2, 33, 7]]
    results = {}
    for lean in (True, False):
        target.lean = lean
        cache = target.new_cache(slots=2, capacity=32)
        out = [target.forward(torch.tensor([p]), 0, cache, capture=True, first_slot=i) for i, p in enumerate(prompts)]
        out.append(target.forward(torch.tensor([[12]]), 7, cache, capture=True))  # decode one token in slot 0
        out.append(target.forward(torch.tensor([[6, 1, 50, 19]]), 8, cache, capture=True))  # verify a block in slot 0
        out.append(target.forward_rows([[4, 9, 21], [44]], [12, 4], cache, capture=True))  # ragged rows, slots 0 and 1
        results[lean] = (out, [k.clone() for k in cache.k], [v.clone() for v in cache.v])
    (lean_out, lean_k, lean_v), (hf_out, hf_k, hf_v) = results[True], results[False]
    for (lean_logits, lean_feats), (hf_logits, hf_feats) in zip(lean_out, hf_out):
        torch.testing.assert_close(lean_logits, hf_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lean_feats, hf_feats, rtol=1e-5, atol=1e-5)
    for a, b in zip(lean_k + lean_v, hf_k + hf_v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lean_forward_stays_off_where_the_layers_differ():
    """Sliding-window layers (Gemma 3) and families not listed keep the HF forward."""
    for family in ("gemma3", "gpt_oss"):
        config_cls, model_cls, extra = FAMILIES[family]
        target = TargetModel(model_cls(config_cls(**COMMON, **extra)).eval(), tokenizer=None, path=None)
        assert not target.lean, family
