"""Draft length by load for a GPU deployment: the planner (engine/plan.py) with a roofline of the recipe's GPU for
the step cost T(batch, K) and the draft card's acceptance, written as TensorRT-LLM's
`speculative_config.draft_len_schedule`.

`roofline_cost` prices the target's verify forward and the drafter's as weight, KV-cache and LM-head bytes over HBM
bandwidth against the FLOPs of batch x (K + 1) tokens at the format's tensor-core peak, the larger of the two, plus a
per-layer overhead. On the GPU host, `trtdflash plan --calibrate` scales it to the steps a running deployment
measures and re-plans (calibrate.py).

TensorRT-LLM's readings of the schedule changed between releases: a key was the smallest batch size of its draft
length (tensorrt_llm/_torch/speculative/drafter.py before 1.3), and is now the largest (`get_draft_len_for_batch_size`
in tensorrt_llm/_torch/speculative/utils.py, main; batch sizes above the last key draft nothing). `schedule()` writes
both ends of every run of equal lengths, up to max_batch_size, so either reading gives every batch size its planned
length; its smallest key is 1 and maps to max_draft_len, as upstream's validator requires.
"""

from __future__ import annotations

from collections.abc import Callable

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.deploy.memory import _kv_bytes, _weight_rows
from trtllm_dflash.deploy.recipes import Recipe
from trtllm_dflash.engine.plan import Acceptance, DraftSchedule, plan_schedule
from trtllm_dflash.errors import DFlashError

BW_EFFICIENCY = 0.7  # share of HBM bandwidth a decode step's kernels reach
FLOP_EFFICIENCY = 0.5  # share of the tensor-core peak a step's GEMMs reach
# Per layer of a forward: what keeps a small batch's step above its roofline (kernel boundaries, synchronisation).
# 50 µs puts Qwen3-8B's decode step on a B200 near SGLang's published ~5 ms (sglang PR #23000's baseline).
LAYER_OVERHEAD_S = 50e-6
CONTEXT = 2048  # tokens of context a running request holds on average, for the KV reads
UNKNOWN_TAU = 3.0  # a draft with no published acceptance: about what chat traffic gets from the published drafts


def _format(quant: str, recipe: Recipe) -> str:
    """The operand format of the target's GEMMs under `quant` on the recipe's GPU."""
    g = recipe.gpu_spec
    if quant == "nvfp4" and g.nvfp4:
        return "fp4"
    if quant == "fp8" or (quant == "mxfp4" and g.mxfp4_mxfp8):
        return "fp8" if g.fp8 else "bf16"
    return "bf16"


def roofline_parts(recipe: Recipe, context: int = CONTEXT) -> Callable[[int, int], tuple[float, float]]:
    """(verify, drafting) seconds of a step of `batch` rows at draft length K on one GPU of the recipe: the target's
    verify of batch x (K + 1) tokens, and for K > 0 the drafter's forward over as many slots and the LM head on its K
    guesses (0.0 at K = 0). A MoE reads only the experts its tokens route to (each token picks experts_per_token of
    num_experts; the expected distinct share is 1 - (1 - k/E)^tokens)."""
    m, d, p, g = recipe.model_facts, recipe.draft_config, recipe.parallel, recipe.gpu_spec
    if d is None:
        raise DFlashError(f"{recipe.id} has no draft to plan draft lengths for.")
    rows = dict(_weight_rows(m, d, p, recipe.quant))
    experts = rows.get("target experts", 0.0)
    dense = sum(b for label, b in rows.items() if not label.startswith("draft") and label != "target experts")
    draft_bytes = rows["draft weights (bf16)"]
    head_bytes = m.vocab_size * m.hidden_size * 2 / (1 if p.attention_dp else p.tp)
    active = (
        m.param_count
        if not m.is_moe
        else m.param_count
        - m.num_layers * m.hidden_size * m.intermediate_size * 3 * (m.num_experts - m.experts_per_token)
    )
    shard = p.tp * p.pp
    peak = g.peak_flops(_format(recipe.quant, recipe)) * FLOP_EFFICIENCY
    bandwidth = g.hbm_bytes_per_s * BW_EFFICIENCY
    draft_kv_per_token = 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_dim * 2

    def forward(bytes_read: float, flops: float, layers: int) -> float:
        return max(bytes_read / bandwidth, flops / peak) + layers * LAYER_OVERHEAD_S

    def parts(batch: int, k: int) -> tuple[float, float]:
        tokens = batch * (k + 1)
        share = 1 - (1 - m.experts_per_token / m.num_experts) ** tokens if m.is_moe else 1.0
        kv = _kv_bytes(m, p, recipe.kv_cache_dtype, batch, context, 0)
        attn = 4 * m.num_layers * m.num_heads * m.head_dim * context * tokens / shard
        verify = forward(dense + share * experts + kv, 2 * active * tokens / shard + attn, m.num_layers // p.pp)
        if k == 0:
            return verify, 0.0
        d_flops = 2 * (d.param_count * tokens + m.vocab_size * m.hidden_size * batch * k) / shard
        drafting = forward(
            draft_bytes + head_bytes + batch * context * draft_kv_per_token / shard, d_flops, d.num_hidden_layers + 1
        )
        return verify, drafting

    return parts


def roofline_cost(recipe: Recipe, context: int = CONTEXT) -> Callable[[int, int], float]:
    """T(batch, K): a step's seconds on one GPU of the recipe, verify and drafting (roofline_parts)."""
    parts = roofline_parts(recipe, context)
    return lambda batch, k: sum(parts(batch, k))


def recipe_acceptance(recipe: Recipe) -> Acceptance:
    """The recipe's draft acceptance: a measured profile's (build --acceptance-profile), else the preset's
    `draft_acceptance` (a published τ with its source), else UNKNOWN_TAU, labelled as assumed."""
    if recipe.draft_profile is not None:
        conditional, source = recipe.draft_profile
        return Acceptance(conditional, source)
    d: DraftConfig = recipe.draft_config
    tau, block, source = recipe.draft_acceptance or (UNKNOWN_TAU, d.block_size, "assumed (no published τ)")
    return Acceptance.from_tau(tau, block, source)


def plan_recipe_schedule(recipe: Recipe, cap: int) -> DraftSchedule:
    """The planned schedule of a recipe whose draft lengths may reach `cap` (its draft's block size - 1 at most)."""
    acceptance = recipe_acceptance(recipe)
    g = recipe.gpu_spec
    inputs = (
        ("acceptance", acceptance.source),
        ("cost", f"roofline of {recipe.num_gpus}x {g.name}"),
        ("HBM", f"{g.hbm_bytes_per_s / 1e12:g} TB/s x {BW_EFFICIENCY:g}"),
        ("peak", f"{g.peak_flops(_format(recipe.quant, recipe)) / 1e12:g} TFLOP/s x {FLOP_EFFICIENCY:g}"),
        ("context", f"{min(CONTEXT, recipe.max_seq_len)} tokens"),
    )
    cost = roofline_cost(recipe, min(CONTEXT, recipe.max_seq_len))
    return plan_schedule(acceptance, cost, recipe.max_batch_size, cap, inputs)
