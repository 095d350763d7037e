"""The target adapter works across HF families: taps, cache cropping and verification stay lossless."""

import pytest
import torch
import transformers

from trtllm_dflash.config import DraftConfig, SamplingParams
from trtllm_dflash.generate import GenerationStats, speculative_stream
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.target import TargetModel

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, {"sliding_window": 4}),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4, "layer_types": None}),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # small models: thread sync would dominate


@pytest.mark.parametrize("family", FAMILIES)
def test_family_greedy_lossless(family):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**COMMON, **extra, initializer_range=0.5)
    target = TargetModel(model_cls(config).eval().requires_grad_(False), tokenizer=None, path=None)
    cfg = DraftConfig.for_target(target.text_config, vocab_rows=target.vocab_rows, num_layers=2, block_size=4, mask_token_id=63)
    draft = DFlashDraftModel(cfg)
    draft.init_weights(generator=torch.Generator().manual_seed(1))
    target.set_taps(cfg.target_layer_ids)
    prompt = [3, 17, 9, 40, 22, 5, 11, 30, 2, 8]
    hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = hf[0, len(prompt):].tolist()
    for block in (1, 4):
        stats = GenerationStats()
        out = [t for s in speculative_stream(target, draft if block > 1 else None, prompt, 24, block, SamplingParams(), frozenset(), stats) for t in s]
        assert out == ref, (family, block)
