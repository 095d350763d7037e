"""The exact keyword arguments for `tensorrt_llm.LLM(**kwargs)` (Triton's model.yaml) and `trtllm-serve --config`.

The recipe is valid by construction (layout, quantization and draft rules run when a Recipe is built or
derived); here the recipe becomes LLM-API keys, the recipe's extra `llm_args` and the caller's `extra` are
merged in, and the result is checked against the field lists and validators of one TensorRT-LLM release
(schema.py). mask_token_id and target_layer_ids are left to TensorRT-LLM, which reads them from the draft's
config.json.

The two files differ in one key. `num_postprocess_workers` detokenizes in worker processes that need
`postprocess_tokenizer_dir`, which only trtllm-serve sets (tensorrt_llm/commands/serve.py); through `LLM(**model.yaml)`
the workers have no tokenizer, and what they carry back lacks `decoding_iter`. The Triton model detokenizes itself,
so model.yaml never has it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from trtllm_dflash.deploy.recipes import Recipe
from trtllm_dflash.deploy.schedule import plan_recipe_schedule
from trtllm_dflash.deploy.trtllm.schema import validate_llm_args
from trtllm_dflash.engine.plan import DraftSchedule
from trtllm_dflash.errors import DFlashError

POSTPROCESS_WORKERS = "num_postprocess_workers"

# keys the recipe owns: setting them through llm_args/extra would desynchronise the memory plan
_OWNED = {
    "tensor_parallel_size": "--tp",
    "pipeline_parallel_size": "--tp/--pp",
    "moe_expert_parallel_size": "--ep",
    "moe_tensor_parallel_size": "--tp/--ep",
    "enable_attention_dp": "the recipe's parallel.attention_dp",
    "max_batch_size": "--max-batch-size",
    "max_seq_len": "--max-seq-len",
    "max_num_tokens": "the recipe's max_num_tokens",
    "model": "the model argument",
}


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = (
            _merge(out[key], value)
            if isinstance(out.get(key), dict) and isinstance(value, Mapping)
            else copy.deepcopy(value)
        )
    return out


def planned_schedule(recipe: Recipe, extra: Mapping[str, Any] | None = None) -> DraftSchedule | None:
    """The draft lengths by load planned for `recipe` (deploy/schedule.py), or None where there is no draft or the
    recipe's llm_args or the extra options choose them (a schedule, max_concurrency or max_draft_len of their own)."""
    chosen = [
        k
        for u in (recipe.llm_args, extra or {})
        for k in (u.get("speculative_config") or {})
        if k in ("draft_len_schedule", "max_concurrency", "max_draft_len")
    ]
    if recipe.draft_config is None or chosen:
        return None
    return plan_recipe_schedule(recipe, recipe.max_draft_len)


def llm_options(
    recipe: Recipe,
    *,
    model: str,
    draft: str | None,
    extra: Mapping[str, Any] | None = None,
    where: str = "model.yaml",
    trtllm_version: str | None = None,
    serve: bool = False,
) -> dict[str, Any]:
    """LLM-API options for `recipe` with target `model` and DFlash draft `draft` (a hub id or a local path): for
    `LLM(**options)` (Triton's model.yaml), or with `serve` for trtllm-serve's --config."""
    for source, update in (("the recipe's llm_args", recipe.llm_args), ("extra options", extra or {})):
        owned = sorted(set(update) & set(_OWNED))
        if owned:
            raise DFlashError(f"{where}: {owned[0]} comes from {_OWNED[owned[0]]}, not from {source}.")
    if (draft is None) != (recipe.draft_config is None):
        raise DFlashError(
            f"{where}: recipe {recipe.id} {'needs a DFlash draft' if draft is None else 'has no DFlash draft facts'}."
        )
    p = recipe.parallel
    options: dict[str, Any] = {
        "model": model,
        "tensor_parallel_size": p.tp,
        "pipeline_parallel_size": p.pp,
        "enable_attention_dp": p.attention_dp,
        "max_batch_size": recipe.max_batch_size,
        "max_seq_len": recipe.max_seq_len,
        "max_num_tokens": recipe.max_num_tokens,
        "attn_backend": recipe.attn_backend,
        "kv_cache_config": {
            "free_gpu_memory_fraction": recipe.free_gpu_memory_fraction,
            "dtype": recipe.kv_cache_dtype,
        },
        "cuda_graph_config": (
            {"enable_padding": True, "batch_sizes": list(recipe.cuda_graph_batch_sizes)}
            if recipe.cuda_graph_batch_sizes
            else None
        ),
    }
    if recipe.model_facts.is_moe:
        options["moe_expert_parallel_size"] = p.ep
    if recipe.moe_backend:
        options["moe_config"] = {"backend": recipe.moe_backend}
    if draft is not None:
        options["speculative_config"] = {
            "decoding_type": "DFlash",
            "max_draft_len": recipe.max_draft_len,
            "speculative_model": draft,
        }
        plan = planned_schedule(recipe, extra)
        if plan is not None:
            options["speculative_config"] |= {
                "max_draft_len": plan.max_draft_len,
                "draft_len_schedule": plan.schedule(),
            }
    recipe_args = {k: v for k, v in recipe.llm_args.items() if serve or k != POSTPROCESS_WORKERS}
    options = _merge(_merge(options, recipe_args), extra or {})
    validate_llm_args(options, where, trtllm_version)
    if not serve and (options.get(POSTPROCESS_WORKERS) or 0) > 0 and not options.get("postprocess_tokenizer_dir"):
        raise DFlashError(
            f"{where}: {POSTPROCESS_WORKERS} needs postprocess_tokenizer_dir through LLM(): TensorRT-LLM's "
            "postprocess workers would have no tokenizer and would not carry decoding_iter back."
        )
    spec = options.get("speculative_config") or {}
    windowed = recipe.draft_config.trtllm_noncausal_window() if recipe.draft_config is not None else None
    if spec.get("attention_backend") == "TRTLLM" and windowed is not None:
        # TensorRT-LLM refuses it when the drafter starts (PR #19159: speculative/dflash.py @10e95278 calls
        # validate_block_attention_windows): trtllm-gen's context kernel has no non-causal sliding window
        layer, window = windowed
        raise DFlashError(
            f"{where}: the TRTLLM drafter attention cannot run draft layer {layer} non-causally within a "
            f"{window}-token sliding window (trtllm-gen has no non-causal sliding window), so TensorRT-LLM refuses "
            "it; use speculative_config.attention_backend VANILLA, the default."
        )
    if spec.get("attention_backend") == "TRTLLM" and recipe.gpu_spec.sm not in (100, 103):
        raise DFlashError(
            f"{where}: the DFlash TRTLLM drafter attention needs an SM100/SM103 Blackwell GPU; "
            f"use VANILLA on {recipe.gpu}."
        )
    if options.get("attention_dp_config") and not p.attention_dp:
        raise DFlashError(f"{where}: attention_dp_config is set but the recipe does not enable attention-DP.")
    return options


def serve_options(
    recipe: Recipe,
    *,
    draft: str | None,
    extra: Mapping[str, Any] | None = None,
    where: str = "config.yaml",
    trtllm_version: str | None = None,
) -> dict[str, Any]:
    """The `trtllm-serve <model> --config` YAML: llm_options without `model` (trtllm-serve takes it as argument)."""
    options = llm_options(
        recipe, model=recipe.hf_id, draft=draft, extra=extra, where=where, trtllm_version=trtllm_version, serve=True
    )
    del options["model"]
    return options
