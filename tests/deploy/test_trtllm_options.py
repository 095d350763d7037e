"""LLM-API options: what the recipe becomes, and the schema catching a bad key in every section."""

import dataclasses

import pytest

from trtllm_dflash.deploy.recipes import load_recipe
from trtllm_dflash.deploy.trtllm.options import llm_options, serve_options
from trtllm_dflash.deploy.trtllm.schema import DEFAULT_RELEASE, RELEASES, release, validate_llm_args
from trtllm_dflash.errors import DFlashError


def test_gpt_oss_throughput_options():
    r = load_recipe("gpt-oss-120b")
    o = llm_options(r, model="/models/gpt-oss-120b", draft="/models/draft")
    assert o["model"] == "/models/gpt-oss-120b"
    assert (o["tensor_parallel_size"], o["moe_expert_parallel_size"], o["enable_attention_dp"]) == (8, 8, True)
    assert o["moe_config"] == {"backend": "TRTLLM"}
    assert o["kv_cache_config"] == {"free_gpu_memory_fraction": 0.85, "dtype": "fp8"}
    assert o["speculative_config"] == {
        "decoding_type": "DFlash",
        "max_draft_len": 3,
        "speculative_model": "/models/draft",
        "draft_len_schedule": {1: 3, r.max_batch_size: 3},  # planned (test_schedule.py): 3 pays at every load
    }
    assert o["attention_dp_config"]["enable_balance"] is True
    assert o["cuda_graph_config"]["batch_sizes"][-1] == r.max_batch_size
    serve = serve_options(r, draft="/models/draft")
    # trtllm-serve gives its postprocess workers a tokenizer; LLM(**model.yaml) would not (options.py)
    assert serve.pop("num_postprocess_workers") == 4 and "num_postprocess_workers" not in o
    assert "model" not in serve and serve == {k: v for k, v in o.items() if k != "model"}


def test_dense_options_have_no_moe_keys():
    o = llm_options(load_recipe("qwen3-8b"), model="Qwen/Qwen3-8B", draft="z-lab/Qwen3-8B-DFlash-b16")
    assert "moe_expert_parallel_size" not in o and "moe_config" not in o


SECTION_TYPOS = [
    ({"max_batch_sise": 8}, "max_batch_sise is not a .* TorchLlmArgs field .did you mean max_batch_size"),
    (
        {"kv_cache_config": {"free_gpu_mem_fraction": 0.9}},
        "kv_cache_config.free_gpu_mem_fraction is not a .* KvCacheConfig field .did you mean free_gpu_memory_fraction",
    ),
    ({"cuda_graph_config": {"enable_pading": True}}, "cuda_graph_config.enable_pading .*did you mean enable_padding"),
    ({"moe_config": {"backnd": "CUTLASS"}}, "moe_config.backnd is not a .* MoeConfig field .did you mean backend"),
    ({"attention_dp_config": {"enable_balanse": True}}, "attention_dp_config.enable_balanse .* AttentionDpConfig"),
    (
        {"speculative_config": {"decoding_type": "DFlash", "max_draft_length": 3}},
        "speculative_config.max_draft_length is not a .* DFlashDecodingConfig field .did you mean max_draft_len",
    ),
]


@pytest.mark.parametrize("options, message", SECTION_TYPOS)
def test_schema_catches_a_typo_in_every_section(options, message):
    with pytest.raises(DFlashError, match=message):
        validate_llm_args(options, "model.yaml")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kv_cache_config": {"dtype": "fp16"}}, "kv_cache_config.dtype is 'fp16'"),
        ({"moe_config": {"backend": "TRTLLMX"}}, "moe_config.backend is 'TRTLLMX'"),
        ({"attn_backend": "FLASH"}, "attn_backend is 'FLASH'"),
        ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "Input should be less than or equal to 1"),
        ({"max_batch_size": "64"}, "max_batch_size must be int"),
        ({"enable_attention_dp": 1}, "enable_attention_dp must be bool"),
        ({"speculative_config": {"decoding_type": "Eagle3"}}, "decoding_type must be DFlash"),
        ({"kv_cache_config": 0.9}, "kv_cache_config must be a mapping"),
    ],
)
def test_schema_checks_types_and_enums(options, message):
    with pytest.raises(DFlashError, match=message):
        validate_llm_args(options, "model.yaml")


def test_schema_accepts_upstream_values():
    for name in RELEASES:
        validate_llm_args(
            {
                "load_format": "dummy",
                "kv_cache_config": {"dtype": "FP8", "max_tokens": None},
                "speculative_config": {
                    "decoding_type": "DFlash",
                    "speculative_model_dir": "/d",
                    "max_draft_len": 3,
                    "attention_backend": "TRTLLM",
                },
            },
            "x",
            name,
        )
    assert release().name == DEFAULT_RELEASE and release("main@0004396").commit.startswith("0004396")


DFLASH = {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "/d"}


@pytest.mark.parametrize(
    "name, options",
    [
        ("1.4.0rc1", {"speculative_config": {**DFLASH, "attention_backend": "FA4"}}),
        (
            "1.4.0rc1",
            {
                "speculative_config": {
                    **DFLASH,
                    "moe_backend": "CUTLASS",
                    "context_recompute_tail": 2,
                    "spec_dec_variant": 1,
                    "skip_ctx_buffer_budget_check": True,
                }
            },
        ),
        ("1.4.0rc1", {"moe_config": {"backend": "CUTEDSL_FC12"}}),
        ("1.4.0rc4", {"speculative_config": {**DFLASH, "attention_backend": "FA4", "moe_tactic": None}}),
        ("1.4.0rc4", {"moe_config": {"backend": "CUTEDSL_FC12", "megamoe_fuse_shared_expert": True}}),
    ],
)
def test_each_release_has_its_own_fields(name, options):
    """What a release accepts, its predecessor refuses: the field lists are per release, not one main commit."""
    validate_llm_args(options, "model.yaml", name)
    with pytest.raises(DFlashError, match="TensorRT-LLM main@0004396|accepts"):
        validate_llm_args(options, "model.yaml", "main@0004396")


# upstream's own messages: tensorrt_llm/llmapi/llm_args.py at main@0004396 (schema.py names each validator)
@pytest.mark.parametrize(
    "options, message",
    [
        ({"speculative_config": {**DFLASH, "max_draft_len": 0}}, "DFlash max_draft_len must be > 0"),
        (
            {"speculative_config": {**DFLASH, "draft_len_schedule": {4: 3, 1: 2}}},
            r"draft_len_schedule\[1\] must equal max_draft_len because it is the smallest batch-size key. "
            r"Got schedule\[1\]=2, but max_draft_len=3.",
        ),
        (
            {"speculative_config": {**DFLASH, "draft_len_schedule": {1: 3, 8: 5}}},
            "draft_len_schedule: all draft lengths must be <= max_draft_len. Got draft_len=5 for batch_size=8, but max_draft_len=3.",
        ),
        (
            {"speculative_config": {**DFLASH, "draft_len_schedule": {0: 3}}},
            "draft_len_schedule: batch size threshold must be >= 1, got 0",
        ),
        (
            {"speculative_config": {**DFLASH, "draft_len_schedule": {1: 3, 8: -1}}},
            "draft_len_schedule: draft length must be >= 0, got -1",
        ),
        (
            {"speculative_config": {**DFLASH, "max_concurrency": 16, "draft_len_schedule": {1: 3, 32: 0}}},
            "max_concurrency and draft_len_schedule are mutually exclusive",
        ),
        ({"speculative_config": {**DFLASH, "max_concurrency": 0}}, "Input should be greater than 0"),
        (
            {"cuda_graph_config": {"batch_sizes": [1, 2, 4], "max_batch_size": 8}},
            r"CudaGraphConfig.max_batch_size is incompatible with CudaGraphConfig.batch_sizes. When both are provided, "
            r"max_batch_size must equal max\(batch_sizes\).",
        ),
        (
            {"stream_interval": 0},
            "stream_interval is 0; TensorRT-LLM's TorchLlmArgs says: Input should be greater than 0",
        ),
        (
            {"kv_cache_config": {"free_gpu_memory_fraction": None}},
            "kv_cache_config.free_gpu_memory_fraction must be a float between 0 and 1",
        ),
    ],
)
def test_upstream_validators_refuse_what_llm_refuses(options, message):
    for name in RELEASES:
        with pytest.raises(DFlashError, match=message):
            validate_llm_args(options, "model.yaml", name)


def test_a_valid_schedule_and_graph_sizes_pass():
    validate_llm_args(
        {
            "speculative_config": {**DFLASH, "draft_len_schedule": {1: 3, 16: 2, 64: 0}},
            "cuda_graph_config": {"batch_sizes": [1, 2, 4], "max_batch_size": 4},
        },
        "model.yaml",
    )
    validate_llm_args({"speculative_config": {**DFLASH, "max_concurrency": 32}}, "model.yaml")


def test_an_unknown_release_is_one_sentence():
    with pytest.raises(
        DFlashError,
        match=r"--trtllm-version must be one of 1\.4\.0rc4, 1\.4\.0rc1, 1\.3\.0rc29, main@0004396, got '1\.2\.1'",
    ):
        release("1.2.1")


def test_postprocess_workers_never_reach_llm_without_a_tokenizer():
    """Through LLM(**model.yaml) nothing sets postprocess_tokenizer_dir (only trtllm-serve does)."""
    r = load_recipe("gpt-oss-120b", "b200", "throughput")
    assert r.llm_args["num_postprocess_workers"] == 4
    assert "num_postprocess_workers" not in llm_options(r, model="m", draft="d")
    with pytest.raises(DFlashError, match="num_postprocess_workers needs postprocess_tokenizer_dir through LLM"):
        llm_options(load_recipe("qwen3-8b"), model="m", draft="d", extra={"num_postprocess_workers": 2})
    o = llm_options(
        load_recipe("qwen3-8b"),
        model="m",
        draft="d",
        extra={"num_postprocess_workers": 2, "postprocess_tokenizer_dir": "m"},
    )
    assert o["num_postprocess_workers"] == 2


def test_extra_options_are_merged_and_validated():
    r = load_recipe("qwen3-8b", "b200")
    o = llm_options(
        r,
        model="m",
        draft="d",
        extra={"kv_cache_config": {"enable_block_reuse": False}, "speculative_config": {"attention_backend": "TRTLLM"}},
    )
    assert o["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9, "dtype": "fp8", "enable_block_reuse": False}
    assert o["speculative_config"]["attention_backend"] == "TRTLLM"
    with pytest.raises(DFlashError, match="kv_cache_config.enable_blok_reuse"):
        llm_options(r, model="m", draft="d", extra={"kv_cache_config": {"enable_blok_reuse": False}})


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tensor_parallel_size": 4}, "tensor_parallel_size comes from --tp, not from extra options"),
        (
            {"speculative_config": {"attention_backend": "TRTLLM"}},
            "needs an SM100/SM103 Blackwell GPU; use VANILLA on h100",
        ),
        ({"attention_dp_config": {"enable_balance": True}}, "attention_dp_config is set but the recipe does not"),
    ],
)
def test_option_rules(extra, message):
    with pytest.raises(DFlashError, match=message):
        llm_options(load_recipe("qwen3-8b", "h100"), model="m", draft="d", extra=extra)


def test_recipe_llm_args_are_checked_too():
    r = dataclasses.replace(load_recipe("qwen3-8b"), llm_args={"stream_intervall": 4})
    with pytest.raises(DFlashError, match="stream_intervall .*did you mean stream_interval"):
        llm_options(r, model="m", draft="d")
    with pytest.raises(DFlashError, match="needs a DFlash draft"):
        llm_options(load_recipe("qwen3-8b"), model="m", draft=None)
