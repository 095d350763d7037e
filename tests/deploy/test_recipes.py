"""Recipes: every preset loads and validates; lookups fail with a sentence listing what exists."""

import dataclasses
import shutil

import pytest
import torch
import yaml

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.deploy import recipes
from trtllm_dflash.deploy.memory import plan_recipe
from trtllm_dflash.deploy.recipes import (
    ModelFacts,
    Parallelism,
    Recipe,
    load_recipe,
    model_facts_from_hf_config,
    presets,
)
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.draft import DFlashDraftModel

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
    assert r.draft_hf_id.startswith("z-lab/") and r.draft_config is not None
    assert r.draft_config.hidden_size == r.model_facts.hidden_size


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


def test_the_published_draft_config_plans_like_the_preset():
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
    published, r = DraftConfig.from_dict(raw), load_recipe("qwen3-8b")
    for name in recipes._DRAFT_KEYS:  # every fact a preset's draft section gives
        assert getattr(published, name) == getattr(r.draft_config, name), name
    assert plan_recipe(dataclasses.replace(r, draft_config=published)) == plan_recipe(r)


def test_draft_param_count_is_the_modules_less_qk_norms():
    # param_count leaves out the per-head QK-norm weights (under 0.1%); everything else is the module's own.
    cfg = DraftConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=96,
        vocab_size=100,
        block_size=4,
        mask_token_id=5,
        target_layer_ids=[0, 2],
    )
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    numel = sum(p.numel() for p in model.parameters())
    assert cfg.param_count == numel - cfg.num_hidden_layers * 2 * cfg.head_dim
    # z-lab/Qwen3-8B-DFlash-b16: ~1.05 B parameters
    assert load_recipe("qwen3-8b").draft_config.param_count == pytest.approx(1.05e9, rel=0.01)


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
    d = r.draft_config
    for draft, message in (
        (dataclasses.replace(d, hidden_size=2560), "hidden size 2560 differs"),
        (dataclasses.replace(d, vocab_size=151000), r"vocabulary \(151000\) differs"),
        (dataclasses.replace(d, target_layer_ids=[1, 40]), "layer id 40 is outside"),
        (dataclasses.replace(d, mask_token_id=151936), "mask token id 151936 is outside"),
    ):
        with pytest.raises(DFlashError, match=message):
            dataclasses.replace(r, draft_config=draft)
    with pytest.raises(DFlashError, match="tp 4 does not divide the draft's 30 attention heads"):
        dataclasses.replace(
            r.with_overrides(tp=4), draft_config=dataclasses.replace(d, num_attention_heads=30, num_key_value_heads=6)
        )


def test_facts_reject_inconsistent_architectures():
    with pytest.raises(DFlashError, match="sliding-attention layers but no sliding_window"):
        ModelFacts(2, 64, 4, 4, 16, 128, 100, 512, ("sliding_attention", "full_attention"))


DRAFT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    intermediate_size=128,
    vocab_size=100,
    block_size=8,
    mask_token_id=None,
    target_layer_ids=[0],
)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layer_types=["full_attention"]), "The draft lists 1 layer types for 2 layers."),
        (dict(target_layer_ids=[]), "The draft has no target_layer_ids."),
        (dict(num_hidden_layers=0), "The draft's num_hidden_layers must be a positive integer, got 0."),
        (dict(block_size=0), "The draft's block_size must be a positive integer, got 0."),
        (dict(layer_types=["full_attention", "linear_attention"]), "unknown layer type 'linear_attention'; known"),
    ],
)
def test_a_draft_is_checked_alike_from_a_preset_and_from_config_json(tmp_path, monkeypatch, change, message):
    """The same sentence whether the draft comes from a preset's `draft:` section or a checkpoint's config.json."""
    with pytest.raises(DFlashError, match=message):
        DraftConfig(**{**DRAFT, **change})
    with pytest.raises(DFlashError, match=message):
        _preset_with_draft(tmp_path, monkeypatch, {**DRAFT, **change})
    raw = {k: v for k, v in {**DRAFT, **change}.items() if k not in ("mask_token_id", "target_layer_ids")}
    raw["dflash_config"] = {"mask_token_id": 5, "target_layer_ids": change.get("target_layer_ids", [0])}
    with pytest.raises(DFlashError, match=message):
        DraftConfig.from_dict(raw)


def _preset_with_draft(tmp_path, monkeypatch, draft: dict) -> Recipe:
    """qwen3-8b/h100 with its model.yaml's `draft:` section replaced, loaded from a copy of the preset."""
    src = recipes.recipes_root() / "qwen3-8b"
    root = tmp_path / "presets"
    shutil.copytree(src, root / "qwen3-8b")
    meta = yaml.safe_load((src / recipes.MODEL_FILE).read_text())
    meta["draft"] = {"hf_id": meta["draft"]["hf_id"], **draft}
    (root / "qwen3-8b" / recipes.MODEL_FILE).write_text(yaml.safe_dump(meta))
    monkeypatch.setattr(recipes, "recipes_root", lambda: root)
    return load_recipe("qwen3-8b", "h100")


def test_a_preset_draft_takes_the_config_json_names(tmp_path, monkeypatch):
    published = yaml.safe_load((recipes.recipes_root() / "qwen3-8b" / recipes.MODEL_FILE).read_text())["draft"]
    published.pop("hf_id")
    assert _preset_with_draft(tmp_path, monkeypatch, published) == load_recipe("qwen3-8b", "h100")
    old = {"num_layers" if k == "num_hidden_layers" else k: v for k, v in published.items()}
    with pytest.raises(DFlashError, match=r"model.yaml: draft: unknown key 'num_layers'; allowed: .*num_hidden_layers"):
        _preset_with_draft(tmp_path / "old", monkeypatch, old)
    with pytest.raises(DFlashError, match=r"draft: unknown key 'rope_parameters'"):
        _preset_with_draft(tmp_path / "rope", monkeypatch, {**published, "rope_parameters": {}})
    pattern = {**published, "layer_types_pattern": ["full_attention"]}
    assert (
        _preset_with_draft(tmp_path / "pattern", monkeypatch, pattern).draft_config.layer_types
        == ["full_attention"] * 5
    )


def test_a_draft_without_a_mask_token_plans_but_is_never_written():
    """A preset may leave the mask token to TensorRT-LLM (it reads it from the draft checkpoint); such a draft
    description still plans and builds, but it is no config.json."""
    r = load_recipe("llama-3.1-8b-instruct")
    assert r.draft_config.mask_token_id is None and plan_recipe(r).fits
    with pytest.raises(DFlashError, match="has no mask_token_id"):
        r.draft_config.to_dict()
