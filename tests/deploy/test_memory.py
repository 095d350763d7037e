"""Memory plans against public figures and against the formulas' own arithmetic, written out independently."""

import dataclasses

import pytest

from trtllm_dflash.deploy.gpus import GB, GPUSpec, gpu_spec
from trtllm_dflash.deploy.memory import plan_memory, plan_recipe
from trtllm_dflash.deploy.recipes import Parallelism, load_recipe, presets
from trtllm_dflash.errors import DFlashError

WEIGHT_ROWS = (
    "target embeddings + LM head",
    "target attention",
    "target experts",
    "target MLP",
    "target norms + routers",
)
GIB = 2**30


def target_weights(plan):
    return sum(b for label, b in plan.rows if label in WEIGHT_ROWS)


def one_gpu(recipe, **limits):
    p = dict(max_batch_size=1, max_seq_len=8192, max_num_tokens=8192, max_draft_len=0, cuda_graph_batch_sizes=())
    p.update(limits)
    r = recipe.with_overrides(tp=1, ep=1)
    return plan_memory(
        r.model_facts,
        None,
        Parallelism(),
        r.quant,
        "auto",
        p["max_batch_size"],
        p["max_seq_len"],
        r.gpu_spec,
        1,
        max_num_tokens=p["max_num_tokens"],
        max_draft_len=p["max_draft_len"],
        cuda_graph_batch_sizes=p["cuda_graph_batch_sizes"],
    )


@pytest.mark.parametrize("rid", [rid for ids in presets().values() for rid in ids])
def test_every_shipped_recipe_fits(rid):
    model, stem = rid.split("/")
    gpu, _, profile = stem.partition("-")
    plan = plan_recipe(load_recipe(model, gpu, profile or None))
    assert plan.fits and plan.max_batch_size_that_fits >= plan.max_batch_size
    assert plan.total_bytes == sum(b for _, b in plan.rows)


def test_gpt_oss_120b_checkpoint_size_and_one_80gb_gpu():
    # OpenAI's gpt-oss model card: 60.8 GiB checkpoint (MXFP4 experts), "fits into a single 80 GB GPU".
    plan = one_gpu(load_recipe("gpt-oss-120b", "h100"))
    assert target_weights(plan) == pytest.approx(60.8 * GIB, rel=0.03)
    assert plan.gpu_memory_bytes == 80 * GB and plan.fits


def test_gpt_oss_20b_checkpoint_size_and_16gb():
    # OpenAI's gpt-oss model card: 12.8 GiB checkpoint, "runs within 16 GB of memory".
    plan = one_gpu(load_recipe("gpt-oss-20b", "h100"), max_seq_len=4096, max_num_tokens=2048)
    assert target_weights(plan) == pytest.approx(12.8 * GIB, rel=0.03)
    r = load_recipe("gpt-oss-20b", "h100")
    sixteen = GPUSpec("16gb", 16 * GB, "hopper", 90, fp8=True, nvfp4=False, mxfp4_mxfp8=False)
    plan16 = plan_memory(
        r.model_facts, None, Parallelism(), "mxfp4", "auto", 1, 4096, sixteen, 1, max_num_tokens=2048, max_draft_len=0
    )
    assert plan16.fits and plan16.total_bytes < 16 * GB


def test_qwen3_8b_bf16_weights():
    # Qwen3-8B: 8.19 B parameters -> about 16.4 GB in bf16 (the published safetensors total).
    plan = one_gpu(load_recipe("qwen3-8b").with_overrides(quant="none"))
    assert target_weights(plan) == pytest.approx(16.4e9, rel=0.01)
    fp8 = one_gpu(load_recipe("qwen3-8b"))
    assert target_weights(fp8) < 0.6 * target_weights(plan)  # linears halve, embeddings stay bf16


def test_tp8_shards_weights_about_eightfold():
    lat = plan_recipe(load_recipe("gpt-oss-120b", "b200", "latency"))
    whole = one_gpu(load_recipe("gpt-oss-120b", "h100"))
    assert 1.0 <= 8 * target_weights(lat) / target_weights(whole) < 1.05
    dep = plan_recipe(load_recipe("gpt-oss-120b", "b200", "throughput"))
    # attention-DP replicates attention, embeddings and LM head
    assert dep.row("target attention") == 8 * lat.row("target attention")
    assert dep.row("target experts") == pytest.approx(lat.row("target experts"), rel=1e-9)


def test_kv_cache_arithmetic():
    r = load_recipe("qwen3-8b").with_overrides(quant="none", kv_cache_dtype="auto")
    plan = plan_memory(
        r.model_facts, None, Parallelism(), "none", "auto", 1, 1024, "h100", 1, max_num_tokens=1024, max_draft_len=0
    )
    assert plan.kv_cache_bytes == 36 * 8 * 128 * 2 * 2 * 1024  # layers x kv heads x head dim x K,V x bf16
    fp8 = plan_memory(
        r.model_facts, None, Parallelism(), "none", "fp8", 1, 1024, "h100", 1, max_num_tokens=1024, max_draft_len=0
    )
    assert fp8.kv_cache_bytes * 2 == plan.kv_cache_bytes


def test_sliding_layers_hold_only_the_window():
    m = load_recipe("gpt-oss-20b").model_facts
    plan = plan_memory(m, None, Parallelism(), "mxfp4", "auto", 1, 4096, "h100", 1, max_num_tokens=256, max_draft_len=0)
    assert plan.kv_cache_bytes == (12 * 4096 + 12 * 128) * 8 * 64 * 2 * 2


def test_kv_heads_fewer_than_tp_keep_one_per_rank_and_attention_dp_keeps_all():
    m = load_recipe("qwen3-8b").model_facts
    four = dataclasses.replace(m, num_kv_heads=4)
    kv = {
        tp: plan_memory(
            four, None, Parallelism(tp=tp), "none", "auto", 8, 1024, "h100", tp, max_num_tokens=1024, max_draft_len=0
        ).kv_cache_bytes
        for tp in (1, 4, 8)
    }
    assert kv[4] == kv[8] == kv[1] // 4
    adp = plan_memory(
        four,
        None,
        Parallelism(tp=8, attention_dp=True),
        "none",
        "auto",
        8,
        1024,
        "h100",
        8,
        max_num_tokens=1024,
        max_draft_len=0,
    )
    assert adp.kv_cache_bytes == kv[1]


def test_dflash_arena_is_dense_in_seq_and_batch():
    r = load_recipe("qwen3-8b")
    d = r.draft_config
    plan = plan_memory(
        r.model_facts, d, Parallelism(), "fp8", "fp8", 32, 16384, "h100", 1, max_num_tokens=8192, max_draft_len=15
    )
    assert plan.row("DFlash context arena") == (16384 + 16) * 33 * 5 * 8 * 128 * 2 * 2
    assert plan.row("DFlash capture buffer") == 8192 * 4096 * 5 * 2
    assert plan.row("draft weights (bf16)") == pytest.approx(1.05e9 * 2, rel=0.02)  # ~1.05 B parameters


def test_largest_batch_is_the_fit_boundary():
    r = load_recipe("qwen3-8b")
    best = plan_recipe(r).max_batch_size_that_fits
    assert plan_recipe(r.with_overrides(max_batch_size=best)).fits
    assert not plan_recipe(r.with_overrides(max_batch_size=best + 1)).fits
    text = plan_recipe(r.with_overrides(max_batch_size=best + 1)).describe()
    assert "does NOT fit" in text and f"largest that fits is {best}" in text and "target KV cache" in text


def test_unknown_gpu_and_format():
    m = load_recipe("qwen3-8b").model_facts
    with pytest.raises(DFlashError, match="known GPUs: .*b200"):
        gpu_spec("v100")
    with pytest.raises(DFlashError, match="Cannot plan quant 'int4'"):
        plan_memory(m, None, Parallelism(), "int4", "auto", 1, 1024, "h100", 1, max_num_tokens=1, max_draft_len=0)
