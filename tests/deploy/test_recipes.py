"""Recipes: every preset loads and validates; lookups fail with a sentence listing what exists."""

import dataclasses

import pytest

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.deploy.recipes import (
    DraftFacts,
    ModelFacts,
    Parallelism,
    Recipe,
    draft_facts_from_config,
    load_recipe,
    model_facts_from_hf_config,
    presets,
)
from trtllm_dflash.errors import DFlashError

ALL = [rid for ids in presets().values() for rid in ids]


def _load(rid: str) -> Recipe:
    model, stem = rid.split("/")
    gpu, _, profile = stem.partition("-")
    return load_recipe(model, gpu, profile or None)


def test_required_recipes_exist():
    got = set(ALL)
    for rid in (
        "gpt-oss-120b/b200-throughput",
        "gpt-oss-120b/b200-latency",
        "gpt-oss-120b/b300-throughput",
        "gpt-oss-120b/b300-latency",
        "gpt-oss-120b/h100",
        "gpt-oss-120b/h200",
        "gpt-oss-20b/h100",
        "gpt-oss-20b/b200",
        "qwen3-8b/h100",
        "qwen3-8b/b200",
        "llama-3.1-8b-instruct/h100",
    ):
        assert rid in got
    assert len(presets()) >= 5


@pytest.mark.parametrize("rid", ALL)
def test_every_recipe_loads(rid):
    r = _load(rid)
    assert r.id == rid and r.num_gpus == r.parallel.tp * r.parallel.pp
    assert r.draft_hf_id.startswith("z-lab/") and r.draft_facts is not None
    assert r.draft_facts.hidden_size == r.model_facts.hidden_size


def test_gpt_oss_layouts():
    thr, lat = load_recipe("gpt-oss-120b"), load_recipe("gpt-oss-120b", "b200", "latency")
    assert thr.id == "gpt-oss-120b/b200-throughput"
    assert thr.parallel == Parallelism(tp=8, pp=1, ep=8, attention_dp=True)
    assert lat.parallel.tp == 8 and not lat.parallel.attention_dp
    assert thr.moe_backend == "TRTLLM" and load_recipe("gpt-oss-120b", "h200").moe_backend == "TRITON"
    assert thr.quant == "mxfp4" and thr.model_facts.layer_types[:2] == ("sliding_attention", "full_attention")
    assert load_recipe("qwen3-8b", "b200").quant == "nvfp4" and load_recipe("qwen3-8b").quant == "fp8"


def test_unknown_preset_lists_known():
    with pytest.raises(DFlashError, match="known presets: .*gpt-oss-120b"):
        load_recipe("gpt-oss-999b")


def test_unknown_gpu_and_profile_list_what_exists():
    with pytest.raises(DFlashError, match="no recipe for GPU 'a100'; available: .*b200-latency"):
        load_recipe("gpt-oss-120b", "a100")
    with pytest.raises(DFlashError, match="no 'fast' profile; available: latency, throughput"):
        load_recipe("gpt-oss-120b", "b200", "fast")


def test_overrides_rederive_the_gpu_count_and_revalidate():
    r = load_recipe("gpt-oss-120b", "b200", "latency").with_overrides(tp=4, max_batch_size=16)
    assert r.num_gpus == 4 and r.max_batch_size == 16 and max(r.cuda_graph_batch_sizes) <= 16
    with pytest.raises(DFlashError, match="tp 3 does not divide the target's 64 attention heads"):
        r.with_overrides(tp=3)


def test_llama_param_count_matches_meta():
    # Meta's published count for Llama-3.1-8B: 8,030,261,248 parameters.
    assert load_recipe("llama-3.1-8b-instruct").model_facts.param_count == 8_030_261_248


def test_hf_config_reader_agrees_with_the_recipe():
    # The published openai/gpt-oss-120b config.json (abridged to the keys that size the model).
    cfg = {
        "num_hidden_layers": 36,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4"},
    }
    assert model_facts_from_hf_config(cfg) == load_recipe("gpt-oss-120b").model_facts


def test_hf_config_counts_checkpoint_shapes():
    cfg = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
    }
    facts = model_facts_from_hf_config(cfg, {"a": [1000, 64], "b": [64], "c": [3, 4, 5]})
    assert facts.checkpoint_params == 64000 + 64 + 60 and facts.num_kv_heads == 4 and facts.head_dim == 16
    with pytest.raises(DFlashError, match="no vocab_size"):
        model_facts_from_hf_config({k: v for k, v in cfg.items() if k != "vocab_size"})


def test_draft_facts_from_draft_config_match_the_recipe():
    # z-lab/Qwen3-8B-DFlash-b16 config.json, as published.
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "block_size": 16,
        "num_target_layers": 36,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }
    assert draft_facts_from_config(DraftConfig.from_dict(raw)) == load_recipe("qwen3-8b").draft_facts


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_gpus=4), "tp 8 x pp 1 = 8 GPUs, but the recipe runs on 4"),
        (dict(parallel=Parallelism(tp=8, ep=3)), "ep 3 must divide tp 8"),
        (dict(parallel=Parallelism(tp=1, attention_dp=True), num_gpus=1), "attention-DP needs tp > 1"),
        (dict(gpu="h100"), "the TRTLLM MoE backend .* needs Blackwell; use TRITON on H100"),
        (dict(quant="nvfp4", gpu="h100", moe_backend="TRITON"), "does not ship MXFP4|NVFP4 needs Blackwell"),
        (dict(max_draft_len=10), r"max_draft_len must be in 1\.\.9"),
        (dict(max_draft_len=0), r"max_draft_len must be in 1\.\.9"),
        (dict(max_seq_len=200_000), "exceeds the target's 131072 positions"),
    ],
)
def test_bad_recipes_raise_one_sentence(change, message):
    with pytest.raises(DFlashError, match=message):
        dataclasses.replace(load_recipe("gpt-oss-120b", "b200", "latency"), **change)


def test_expert_and_head_rules():
    r = load_recipe("gpt-oss-120b", "b200", "latency")
    with pytest.raises(DFlashError, match="ep 8 does not divide the target's 100 experts"):
        dataclasses.replace(
            r, model_facts=dataclasses.replace(r.model_facts, num_experts=100), parallel=Parallelism(tp=8, ep=8)
        )
    with pytest.raises(DFlashError, match="the target's 6 KV heads and tp 8 must divide one another"):
        dataclasses.replace(r, model_facts=dataclasses.replace(r.model_facts, num_kv_heads=6, num_heads=48))
    with pytest.raises(DFlashError, match="ep 2 needs a mixture-of-experts target"):
        load_recipe("qwen3-8b").with_overrides(tp=2, ep=2)


def test_quant_needs_the_right_gpu():
    with pytest.raises(DFlashError, match="NVFP4 needs Blackwell; use --quant fp8 on H100"):
        load_recipe("qwen3-8b", "h100").with_overrides(quant="nvfp4")
    with pytest.raises(DFlashError, match="FP8 needs Ada, Hopper or Blackwell; a100"):
        dataclasses.replace(load_recipe("qwen3-8b", "h100"), gpu="a100")
    with pytest.raises(DFlashError, match="does not ship MXFP4 experts"):
        load_recipe("qwen3-8b", "b200").with_overrides(quant="mxfp4")


def test_draft_must_match_the_target():
    r = load_recipe("qwen3-8b")
    d = r.draft_facts
    for facts, message in (
        (dataclasses.replace(d, hidden_size=2560), "hidden size 2560 differs"),
        (dataclasses.replace(d, vocab_size=151000), r"vocabulary \(151000\) differs"),
        (dataclasses.replace(d, target_layer_ids=(1, 40)), "layer id 40 is outside"),
        (dataclasses.replace(d, mask_token_id=151936), "mask token id 151936 is outside"),
    ):
        with pytest.raises(DFlashError, match=message):
            dataclasses.replace(r, draft_facts=facts)


def test_facts_reject_inconsistent_architectures():
    with pytest.raises(DFlashError, match="sliding-attention layers but no sliding_window"):
        ModelFacts(2, 64, 4, 4, 16, 128, 100, 512, ("sliding_attention", "full_attention"))
    with pytest.raises(DFlashError, match="lists 1 layer types for 2 layers"):
        DraftFacts(2, 64, 4, 4, 16, 128, 100, 8, (0,), layer_types=("full_attention",))
