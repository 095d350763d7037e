"""Per-GPU memory plan of a target + DFlash draft deployment under TensorRT-LLM, computed without a GPU.

What each row counts, per GPU:
* Weights by storage format: bf16 = 2 bytes; FP8 = 1 byte + two fp32 per-tensor scales per linear; NVFP4 =
  4-bit values + one E4M3 scale per 16 + fp32 global scales; MXFP4 = 4-bit values + one E8M0 scale per 32.
  fp8/nvfp4 quantize the attention and MLP/expert linears; mxfp4 is gpt-oss's shipped format (experts only).
  Embeddings, LM head, norms and routers stay bf16. Sharding: embeddings and LM head over tp (replicated
  under attention-DP, where the LM head is not TP-split by default); attention over tp, replicated under
  attention-DP; KV projections keep one head per rank when KV heads < tp; experts split over ep, each expert
  over tp // ep; norms and routers replicated; pp splits the layers (the stage with the most layers counts).
* Draft weights (bf16 as published, no embedding / LM head): layers sharded like the target's attention/MLP,
  `fc` replicated; a DFlash2 draft's block convolutions (base kernels and kernel projections) and candidate selector
  (two [vocab, rank] codebooks and the hidden projection) counted whole on every GPU, as `fc`.
* Target KV cache for max_batch_size requests of max_seq_len (+ max_draft_len in-flight drafts) tokens,
  rounded up to 32-token blocks: full-attention layers hold every token, sliding layers only the window.
  Without attention-DP every rank holds every request's KV for its own KV heads; with attention-DP a rank
  holds only its own requests (max_batch_size is per rank there), all KV heads.
* The DFlash drafter's context arena, dense: (max_seq_len + block) x (max_batch_size + 1) x draft layers x
  KV heads x head_dim x 2 (K and V), bf16 (TensorRT-LLM's VANILLA drafter attention; one spare slot absorbs
  CUDA-graph padding), and its capture buffer [max_num_tokens, hidden x len(target_layer_ids)] bf16.
* Activations: the largest transient working set of one forward over max_num_tokens tokens, bf16:
  tokens x (4 x hidden + local q/k/v width + 2 x local MLP width), where an MoE rank's MLP width is
  experts_per_token x intermediate / moe_tp times the share of the global tokens routed to it; plus fp32
  logits for target verification and draft proposals: max_batch_size x (2 x max_draft_len + 1) rows of the
  local vocabulary.
* CUDA graphs: 200 MB per captured batch size, the upper bound TensorRT-LLM documents for
  `cuda_graph_config` (TorchLlmArgs.cuda_graph_config description, llm_args.py @0004396).
* CUDA context, cuBLAS/NCCL workspaces and allocator slack: a 1 GiB constant.
TensorRT-LLM then gives the KV cache `free_gpu_memory_fraction` of what is left after everything else; the
plan fits when the KV cache the limits need is within that pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trtllm_dflash.config import DraftConfig, attention_params, gated_mlp_params
from trtllm_dflash.deploy.gpus import GPUSpec, gpu_spec
from trtllm_dflash.deploy.recipes import ModelFacts, Parallelism, Recipe
from trtllm_dflash.errors import DFlashError

GRAPH_BYTES = 200 * 10**6
RUNTIME_BYTES = 2**30
TOKENS_PER_BLOCK = 32
ACT_BYTES = 2
LOGIT_BYTES = 4

# bytes per parameter of a quantized linear, block scales included
_QUANT_BYTES = {"none": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32}
_PER_TENSOR_SCALE_BYTES = {"none": 0, "fp8": 8, "nvfp4": 8, "mxfp4": 0}
_KV_BYTES = {"auto": 2.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16}


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU byte counts; `fits` when the KV cache the limits need fits TensorRT-LLM's KV pool."""

    rows: tuple[tuple[str, int], ...]
    kv_cache_bytes: int
    total_bytes: int
    gpu: str
    num_gpus: int
    gpu_memory_bytes: int
    kv_pool_bytes: int
    fits: bool
    max_batch_size: int
    max_batch_size_that_fits: int

    def row(self, label: str) -> int:
        return dict(self.rows)[label]

    def describe(self) -> str:
        """A readable per-GPU table for `trtdflash build --dry-run`."""
        width = max(len(label) for label, _ in self.rows) + 2
        lines = [f"Memory per GPU ({self.num_gpus} x {self.gpu}, {self.gpu_memory_bytes / 1e9:.1f} GB each):"]
        lines += [f"  {label:<{width}}{b / 1e9:9.2f} GB" for label, b in self.rows]
        lines.append(f"  {'total':<{width}}{self.total_bytes / 1e9:9.2f} GB")
        lines.append(f"  {'KV pool available':<{width}}{self.kv_pool_bytes / 1e9:9.2f} GB")
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(
            f"  max_batch_size {self.max_batch_size} {verdict}; the largest that fits is "
            f"{self.max_batch_size_that_fits}."
        )
        return "\n".join(lines)


def _local_kv_heads(kv_heads: int, shard: int) -> int:
    return kv_heads // shard if kv_heads >= shard else 1


def _linear_bytes(params: float, quant: str, num_linears: int) -> float:
    return params * _QUANT_BYTES[quant] + num_linears * _PER_TENSOR_SCALE_BYTES[quant]


def _weight_rows(m: ModelFacts, d: DraftConfig | None, p: Parallelism, quant: str) -> list[tuple[str, float]]:
    attn_shard = 1 if p.attention_dp else p.tp
    layers = math.ceil(m.num_layers / p.pp)
    vocab_rows = m.vocab_size / attn_shard
    tables = 1 if (m.tie_word_embeddings or p.pp > 1) else 2  # a pp stage holds the embedding or the head
    linear_quant = "none" if quant == "mxfp4" else quant  # mxfp4 is experts-only (gpt-oss as shipped)
    attn = attention_params(
        m.hidden_size, m.head_dim, m.num_heads // attn_shard, _local_kv_heads(m.num_kv_heads, attn_shard)
    )
    if m.is_moe:
        mlp = m.num_experts // p.ep * gated_mlp_params(m.hidden_size, m.intermediate_size) / p.moe_tp
        mlp_label, mlp_linears = "target experts", 3 * m.num_experts // p.ep
        small = 2 * m.hidden_size + m.hidden_size * m.num_experts
    else:
        mlp = gated_mlp_params(m.hidden_size, m.intermediate_size) / attn_shard
        mlp_label, mlp_linears = "target MLP", 3
        small = 2 * m.hidden_size
    rows = [
        ("target embeddings + LM head", tables * vocab_rows * m.hidden_size * 2),
        ("target attention", layers * _linear_bytes(attn, linear_quant, 4)),
        (mlp_label, layers * _linear_bytes(mlp, quant, mlp_linears)),
        ("target norms + routers", (layers * small + m.hidden_size) * 2),
    ]
    if d is not None:
        d_attn = attention_params(
            d.hidden_size,
            d.head_dim,
            d.num_attention_heads // attn_shard,
            _local_kv_heads(d.num_key_value_heads, attn_shard),
        )
        d_layer = d_attn + gated_mlp_params(d.hidden_size, d.intermediate_size) / attn_shard + 2 * d.hidden_size
        fc = len(d.target_layer_ids) * d.hidden_size * d.hidden_size
        # DFlash2's convolutions and selector: the selector's codebooks alone are 2 x vocab x rank (254 MB in
        # bf16 for Qwen3.8-27B-DFlash2), which a plan without them would leave out of the GPU's budget
        rows.append(
            (
                "draft weights (bf16)",
                (d.num_hidden_layers * d_layer + fc + 2 * d.hidden_size + d.dflash2_params) * 2,
            )
        )
    return rows


def _kv_bytes(m: ModelFacts, p: Parallelism, kv_dtype: str, batch: int, seq: int, draft_len: int) -> float:
    attn_shard = 1 if p.attention_dp else p.tp
    kv_heads = _local_kv_heads(m.num_kv_heads, attn_shard)

    def blocks(tokens: int) -> int:
        return math.ceil((tokens + draft_len) / TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK

    full = m.layer_count("full_attention") * blocks(seq)
    sliding = m.layer_count("sliding_attention") * blocks(min(m.sliding_window or 0, seq))
    per_token_layer = kv_heads * m.head_dim * 2 * _KV_BYTES[kv_dtype]
    return batch * (full + sliding) / p.pp * per_token_layer


def _runtime_rows(
    m: ModelFacts,
    d: DraftConfig | None,
    p: Parallelism,
    batch: int,
    seq: int,
    num_tokens: int,
    draft_len: int,
    graphs: int,
) -> list[tuple[str, float]]:
    attn_shard = 1 if p.attention_dp else p.tp
    rows = []
    if d is not None:
        d_kv = _local_kv_heads(d.num_key_value_heads, attn_shard)
        arena = (seq + d.block_size) * (batch + 1) * d.num_hidden_layers * d_kv * d.head_dim * 2 * 2
        rows.append(("DFlash context arena", arena))
        rows.append(("DFlash capture buffer", num_tokens * d.hidden_size * len(d.target_layer_ids) * ACT_BYTES))
    q_kv = (m.num_heads // attn_shard + 2 * _local_kv_heads(m.num_kv_heads, attn_shard)) * m.head_dim
    if m.is_moe:
        routed_share = (p.tp if p.attention_dp else 1) / p.ep  # tokens from all DP ranks, spread over ep
        mlp_width = m.experts_per_token * m.intermediate_size / p.moe_tp * routed_share
    else:
        mlp_width = m.intermediate_size / attn_shard
    working = num_tokens * (4 * m.hidden_size + q_kv + 2 * mlp_width) * ACT_BYTES
    logits = batch * (2 * draft_len + 1) * (m.vocab_size / attn_shard) * LOGIT_BYTES
    rows.append(("activations + logits", working + logits))
    rows.append(("CUDA graphs", graphs * GRAPH_BYTES))
    rows.append(("CUDA context + runtime", RUNTIME_BYTES))
    return rows


def plan_memory(
    model: ModelFacts,
    draft: DraftConfig | None,
    parallel: Parallelism,
    quant: str,
    kv_cache_dtype: str,
    max_batch_size: int,
    max_seq_len: int,
    gpu: str | GPUSpec,
    num_gpus: int,
    *,
    max_num_tokens: int,
    max_draft_len: int,
    cuda_graph_batch_sizes: tuple[int, ...] = (),
    free_gpu_memory_fraction: float = 0.9,
) -> MemoryPlan:
    """The per-GPU plan for these limits, and the largest max_batch_size that would fit."""
    spec = gpu if isinstance(gpu, GPUSpec) else gpu_spec(gpu)
    if quant not in _QUANT_BYTES or kv_cache_dtype not in _KV_BYTES:
        raise DFlashError(f"Cannot plan quant {quant!r} with KV-cache dtype {kv_cache_dtype!r}.")
    weights = _weight_rows(model, draft, parallel, quant)

    def at(batch: int) -> tuple[list[tuple[str, float]], float, float]:
        graphs = sum(b <= batch for b in cuda_graph_batch_sizes)
        rows = weights + _runtime_rows(
            model, draft, parallel, batch, max_seq_len, max_num_tokens, max_draft_len, graphs
        )
        fixed = sum(b for _, b in rows)
        kv = _kv_bytes(model, parallel, kv_cache_dtype, batch, max_seq_len, max_draft_len)
        pool = max(spec.memory_bytes - fixed, 0) * free_gpu_memory_fraction
        return rows, kv, pool

    def fits(batch: int) -> bool:
        _, kv, pool = at(batch)
        return kv <= pool

    lo, hi = 0, 1
    while fits(hi) and hi < 2**20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    rows, kv, pool = at(max_batch_size)
    rows = rows + [("target KV cache", kv)]
    return MemoryPlan(
        rows=tuple((label, int(b)) for label, b in rows),
        kv_cache_bytes=int(kv),
        total_bytes=int(sum(b for _, b in rows)),
        gpu=spec.name,
        num_gpus=num_gpus,
        gpu_memory_bytes=spec.memory_bytes,
        kv_pool_bytes=int(pool),
        fits=kv <= pool,
        max_batch_size=max_batch_size,
        max_batch_size_that_fits=lo,
    )


def plan_recipe(recipe: Recipe) -> MemoryPlan:
    """plan_memory with a recipe's settings."""
    return plan_memory(
        recipe.model_facts,
        recipe.draft_config,
        recipe.parallel,
        recipe.quant,
        recipe.kv_cache_dtype,
        recipe.max_batch_size,
        recipe.max_seq_len,
        recipe.gpu,
        recipe.num_gpus,
        max_num_tokens=recipe.max_num_tokens,
        max_draft_len=recipe.max_draft_len,
        cuda_graph_batch_sizes=recipe.cuda_graph_batch_sizes,
        free_gpu_memory_fraction=recipe.free_gpu_memory_fraction,
    )
