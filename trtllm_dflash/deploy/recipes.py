"""Deployment recipes: a target's and its DFlash draft's architecture facts plus one GPU layout, checked once.

A preset is a folder `build_configs/<preset>/` holding `model.yaml` (the target's and the draft's facts, each
written once; the draft's under its config.json's key names, read into the same DraftConfig as a checkpoint's)
and one file per deployment, `<gpu>.yaml` or `<gpu>-<profile>.yaml` (GPU count, parallelism, quantization,
limits, LLM-API extras). A `Recipe` is valid by construction: every layout, quantization and
draft/target rule below runs in `__post_init__`, so a recipe derived with `with_overrides` (the CLI's --tp,
--ep, --quant, ...) or `dataclasses.replace` is checked again and fails with one sentence.

The parallel rules are TensorRT-LLM's: `moe_tp_size * moe_ep_size == tp_size` (tensorrt_llm/mapping.py,
Mapping.__init__, NVIDIA/TensorRT-LLM@cf44a1ccee7dd3381a7b4c49a8318c0c3ae4426b lines 112-168), attention heads
split over tp unless attention-DP, and KV heads replicated when there are fewer than tp ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trtllm_dflash.config import (
    DRAFT_SIZES,
    LAYER_TYPES,
    DraftConfig,
    attention_params,
    gated_mlp_params,
    max_draft_len,
)
from trtllm_dflash.deploy.gpus import GPUS, GPUSpec, gpu_spec
from trtllm_dflash.errors import DFlashError

QUANTS = ("none", "fp8", "nvfp4", "mxfp4")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "nvfp4")
WEIGHT_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class ModelFacts:
    """A target LLM's architecture: what sizes its weights and its KV cache (per-expert `intermediate_size`)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    shipped_quant: str = "none"  # the format of the published weights (gpt-oss: MXFP4 experts)
    checkpoint_params: int | None = None  # counted from safetensors shapes, when a local checkpoint was read

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise DFlashError(f"The target's {name} must be a positive integer, got {getattr(self, name)!r}.")
        if len(self.layer_types) != self.num_layers:
            raise DFlashError(f"The target lists {len(self.layer_types)} layer types for {self.num_layers} layers.")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise DFlashError(f"Unknown layer type {bad[0]!r}; known: {', '.join(LAYER_TYPES)}.")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DFlashError("The target has sliding-attention layers but no sliding_window size.")
        if self.num_heads % self.num_kv_heads:
            raise DFlashError(
                f"The target's {self.num_heads} attention heads are not a multiple of its {self.num_kv_heads} KV heads."
            )
        if self.num_experts < 0 or not 0 <= self.experts_per_token <= self.num_experts:
            raise DFlashError(f"The target routes {self.experts_per_token} of {self.num_experts} experts per token.")
        if self.num_experts and not self.experts_per_token:
            raise DFlashError("The target has experts but experts_per_token is 0.")
        if self.dtype not in WEIGHT_DTYPES:
            raise DFlashError(f"Unsupported weight dtype {self.dtype!r}; supported: {', '.join(WEIGHT_DTYPES)}.")
        if self.shipped_quant not in QUANTS:
            raise DFlashError(f"Unknown shipped quantization {self.shipped_quant!r}; known: {', '.join(QUANTS)}.")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types)

    @property
    def param_count(self) -> int:
        """All parameters from the architecture (the cross-check against a checkpoint's shapes)."""
        per_layer = attention_params(self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads)
        if self.is_moe:
            per_layer += self.num_experts * gated_mlp_params(self.hidden_size, self.intermediate_size)
            per_layer += self.hidden_size * self.num_experts  # router
        else:
            per_layer += gated_mlp_params(self.hidden_size, self.intermediate_size)
        per_layer += 2 * self.hidden_size  # two RMSNorms
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size


@dataclass(frozen=True)
class DraftTraining:
    """What a draft was trained on, from its card, where it decides acceptance (deploy/lint.py): the chat template's
    thinking mode (None: the template has none), the longest training sequence, and the target's quantization."""

    thinking: bool | None
    max_context: int
    target_quant: str
    source: str

    def __post_init__(self):
        if self.thinking not in (True, False, None) or not isinstance(self.max_context, int) or self.max_context < 1:
            raise DFlashError(f"draft_training needs thinking true/false/null and a positive max_context, got {self}.")
        if self.target_quant not in QUANTS:
            raise DFlashError(
                f"draft_training: target_quant must be one of {', '.join(QUANTS)}, got {self.target_quant!r}."
            )


@dataclass(frozen=True)
class Parallelism:
    """tp x pp GPUs; MoE experts split over ep and each expert over tp // ep; attention-DP replicates attention."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    attention_dp: bool = False

    def __post_init__(self):
        for name in ("tp", "pp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise DFlashError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep


@dataclass(frozen=True)
class Recipe:
    """One deployment: target + draft on `num_gpus` GPUs of one kind, with every LLM-API setting we choose."""

    id: str
    model: str
    hf_id: str
    model_facts: ModelFacts
    draft_hf_id: str | None
    draft_config: DraftConfig | None  # a preset's `draft:` facts or a local draft's config.json
    gpu: str
    num_gpus: int
    parallel: Parallelism
    quant: str
    kv_cache_dtype: str
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    max_draft_len: int
    free_gpu_memory_fraction: float = 0.9
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    attn_backend: str = "TRTLLM"
    moe_backend: str | None = None
    llm_args: dict[str, Any] = field(default_factory=dict)  # further LLM-API keys, merged by llm_options
    checkpoint: str | None = None  # the quantized checkpoint to load (a ModelOpt export) when quant is not as shipped
    # The draft's published acceptance: (τ, at block size, source), from the preset's model.yaml; None: not known.
    # It plans the draft length by load (deploy/schedule.py); max_draft_len above is that plan's cap.
    draft_acceptance: tuple[float, int, str] | None = None
    draft_training: DraftTraining | None = None  # what the draft was trained on, for the compatibility lint (lint.py)
    # A measured speculation profile (build --acceptance-profile): the conditional acceptance per draft position and
    # where it was measured; it plans the draft lengths in place of draft_acceptance.
    draft_profile: tuple[tuple[float, ...], str] | None = None

    @property
    def weights(self) -> str:
        """What TensorRT-LLM loads: it reads quantization from the checkpoint and does not quantize at load time."""
        return self.checkpoint or self.hf_id

    def __post_init__(self):
        object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sorted(self.cuda_graph_batch_sizes)))
        for check in (_check_limits, _check_layout, _check_quant, _check_draft):
            check(self)

    @property
    def gpu_spec(self) -> GPUSpec:
        return gpu_spec(self.gpu)

    def with_overrides(
        self,
        *,
        tp: int | None = None,
        pp: int | None = None,
        ep: int | None = None,
        attention_dp: bool | None = None,
        quant: str | None = None,
        kv_cache_dtype: str | None = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        max_draft_len: int | None = None,
    ) -> Recipe:
        """This recipe with the CLI's flags applied; changing tp or pp changes the GPU count to tp x pp."""
        given = {k: v for k, v in dict(tp=tp, pp=pp, ep=ep, attention_dp=attention_dp).items() if v is not None}
        parallel = dataclasses.replace(self.parallel, **given)
        changes = {
            k: v
            for k, v in dict(
                quant=quant,
                kv_cache_dtype=kv_cache_dtype,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                max_num_tokens=max_num_tokens,
                max_draft_len=max_draft_len,
            ).items()
            if v is not None
        }
        num_gpus = parallel.tp * parallel.pp if (tp or pp) else self.num_gpus
        graphs = tuple(
            b for b in self.cuda_graph_batch_sizes if b <= changes.get("max_batch_size", self.max_batch_size)
        )
        return dataclasses.replace(self, parallel=parallel, num_gpus=num_gpus, cuda_graph_batch_sizes=graphs, **changes)


def _check_limits(r: Recipe) -> None:
    for name in ("num_gpus", "max_batch_size", "max_seq_len", "max_num_tokens"):
        if not isinstance(getattr(r, name), int) or getattr(r, name) < 1:
            raise DFlashError(f"{r.id}: {name} must be a positive integer, got {getattr(r, name)!r}.")
    if r.max_seq_len > r.model_facts.max_position_embeddings:
        raise DFlashError(
            f"{r.id}: max_seq_len {r.max_seq_len} exceeds the target's "
            f"{r.model_facts.max_position_embeddings} positions."
        )
    if not 0 < r.free_gpu_memory_fraction <= 1:
        raise DFlashError(f"{r.id}: free_gpu_memory_fraction must be in (0, 1], got {r.free_gpu_memory_fraction}.")
    if r.cuda_graph_batch_sizes and (
        r.cuda_graph_batch_sizes[0] < 1 or r.cuda_graph_batch_sizes[-1] > r.max_batch_size
    ):
        raise DFlashError(f"{r.id}: CUDA-graph batch sizes must lie in 1..max_batch_size ({r.max_batch_size}).")


def _check_layout(r: Recipe) -> None:
    p, m, d = r.parallel, r.model_facts, r.draft_config
    if p.tp * p.pp != r.num_gpus:
        raise DFlashError(
            f"{r.id}: tp {p.tp} x pp {p.pp} = {p.tp * p.pp} GPUs, but the recipe runs on "
            f"{r.num_gpus}; choose tp x pp = {r.num_gpus}."
        )
    if p.pp > m.num_layers:
        raise DFlashError(f"{r.id}: pp {p.pp} is more than the target's {m.num_layers} layers.")
    if p.attention_dp and p.tp == 1:
        raise DFlashError(f"{r.id}: attention-DP needs tp > 1 (it spreads requests over the tp ranks).")
    if not p.attention_dp:
        shapes = [("target", m.num_heads, m.num_kv_heads)] + (
            [("draft", d.num_attention_heads, d.num_key_value_heads)] if d else []
        )
        for who, heads, kv in shapes:
            if heads % p.tp:
                raise DFlashError(
                    f"{r.id}: tp {p.tp} does not divide the {who}'s {heads} attention heads; "
                    f"use a tp that divides {heads}."
                )
            if kv % p.tp and p.tp % kv:
                raise DFlashError(f"{r.id}: the {who}'s {kv} KV heads and tp {p.tp} must divide one another.")
    if not m.is_moe:
        if p.ep != 1:
            raise DFlashError(f"{r.id}: ep {p.ep} needs a mixture-of-experts target; {r.model} is dense, use ep 1.")
        return
    if p.tp % p.ep:
        raise DFlashError(f"{r.id}: ep {p.ep} must divide tp {p.tp} (TensorRT-LLM needs moe_tp x moe_ep = tp).")
    if m.num_experts % p.ep:
        raise DFlashError(f"{r.id}: ep {p.ep} does not divide the target's {m.num_experts} experts.")


def _check_quant(r: Recipe) -> None:
    g, m = r.gpu_spec, r.model_facts
    if r.quant not in QUANTS:
        raise DFlashError(f"{r.id}: unknown quantization {r.quant!r}; known: {', '.join(QUANTS)}.")
    if r.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise DFlashError(f"{r.id}: unknown KV-cache dtype {r.kv_cache_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)}.")
    # what to suggest instead of a format this GPU lacks: the target's own MXFP4 experts where they run, else FP8
    hopper_hint = "mxfp4" if m.shipped_quant == "mxfp4" and g.mxfp4_weight_only else "fp8" if g.fp8 else "none"
    if r.quant == "fp8" and not g.fp8:
        raise DFlashError(f"{r.id}: FP8 needs Ada, Hopper or Blackwell; {g.name} cannot run it, use --quant none.")
    if r.quant == "nvfp4" and not g.nvfp4:
        raise DFlashError(f"{r.id}: NVFP4 needs Blackwell; use --quant {hopper_hint} on {g.name.upper()}.")
    if r.quant == "mxfp4":
        if not m.is_moe or m.shipped_quant != "mxfp4":
            raise DFlashError(
                f"{r.id}: MXFP4 here means gpt-oss's experts as shipped; {r.model} does not ship "
                f"MXFP4 experts, use --quant fp8 or nvfp4."
            )
        if not g.mxfp4_weight_only:
            raise DFlashError(f"{r.id}: MXFP4 experts need Hopper or Blackwell; {g.name} cannot run them.")
    if r.kv_cache_dtype == "fp8" and not g.fp8:
        raise DFlashError(
            f"{r.id}: an FP8 KV cache needs Ada, Hopper or Blackwell; use kv_cache_dtype auto on {g.name}."
        )
    if r.kv_cache_dtype == "nvfp4" and not g.nvfp4:
        raise DFlashError(
            f"{r.id}: an NVFP4 KV cache needs Blackwell; use kv_cache_dtype {'fp8' if g.fp8 else 'auto'} on "
            f"{g.name.upper()}."
        )
    if r.moe_backend is not None and not m.is_moe:
        raise DFlashError(f"{r.id}: moe_backend is set but {r.model} has no experts.")
    if r.moe_backend == "TRTLLM" and g.architecture != "blackwell":
        raise DFlashError(
            f"{r.id}: the TRTLLM MoE backend (trtllm-gen kernels) needs Blackwell; use TRITON on {g.name.upper()}."
        )


def _check_draft(r: Recipe) -> None:
    d, m = r.draft_config, r.model_facts
    if d is None:
        if r.max_draft_len:
            raise DFlashError(f"{r.id}: max_draft_len is {r.max_draft_len} but the recipe has no DFlash draft.")
        return
    if not 1 <= r.max_draft_len <= max_draft_len(d.block_size):
        raise DFlashError(
            f"{r.id}: max_draft_len must be in 1..{max_draft_len(d.block_size)} (the draft's block size "
            f"{d.block_size} minus the anchor), got {r.max_draft_len}."
        )
    if d.hidden_size != m.hidden_size:
        raise DFlashError(
            f"{r.id}: the draft's hidden size {d.hidden_size} differs from the target's "
            f"{m.hidden_size}; they share embeddings and LM head, so they must match."
        )
    if d.vocab_size != m.vocab_size:
        raise DFlashError(
            f"{r.id}: the draft's vocabulary ({d.vocab_size}) differs from the target's "
            f"({m.vocab_size}); it uses the target's LM head, so they must match."
        )
    bad = [i for i in d.target_layer_ids if not 0 <= i < m.num_layers]
    if bad:
        raise DFlashError(
            f"{r.id}: draft target layer id {bad[0]} is outside the target's layers 0..{m.num_layers - 1}."
        )
    if d.mask_token_id is not None and not 0 <= d.mask_token_id < m.vocab_size:
        raise DFlashError(
            f"{r.id}: the draft's mask token id {d.mask_token_id} is outside the target's vocabulary of {m.vocab_size}."
        )


# ---------------------------------------------------------------- reading facts from checkpoints


def model_facts_from_hf_config(
    config: Mapping[str, Any], safetensors_shapes: Mapping[str, Sequence[int]] | None = None
) -> ModelFacts:
    """ModelFacts from a Hugging Face config.json (nested text_config honoured) and, if given, tensor shapes."""
    cfg = dict(config.get("text_config") or config)

    def need(*names: str) -> Any:
        for name in names:
            if cfg.get(name) is not None:
                return cfg[name]
        raise DFlashError(f"The target's config.json has no {names[0]}; cannot plan it.")

    layers = int(need("num_hidden_layers"))
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = cfg.get("layer_types") or (["full_attention"] * layers)
    quant = dict(cfg.get("quantization_config") or config.get("quantization_config") or {})
    method = str(quant.get("quant_method") or "none").lower()
    shipped = method if method in QUANTS else str(quant.get("quant_algo") or "none").lower()
    params = None
    if safetensors_shapes is not None:
        params = 0
        for shape in safetensors_shapes.values():
            n = 1
            for s in shape:
                n *= int(s)
            params += n
    return ModelFacts(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(
            need("moe_intermediate_size", "intermediate_size") if experts else need("intermediate_size")
        ),
        vocab_size=int(need("vocab_size")),
        max_position_embeddings=int(need("max_position_embeddings")),
        layer_types=tuple(layer_types),
        sliding_window=int(sliding) if sliding and "sliding_attention" in layer_types else None,
        num_experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        shipped_quant=shipped if shipped in QUANTS else "none",
        checkpoint_params=params,
    )


# ---------------------------------------------------------------- recipe files

MODEL_FILE = "model.yaml"
_MODEL_KEYS = {"hf_id", "defaults", "target", "draft", "draft_acceptance", "draft_training"}
_DEPLOYMENT_KEYS = {
    "checkpoint",
    "num_gpus",
    "parallel",
    "quant",
    "kv_cache_dtype",
    "max_batch_size",
    "max_seq_len",
    "max_num_tokens",
    "max_draft_len",
    "free_gpu_memory_fraction",
    "cuda_graph_batch_sizes",
    "attn_backend",
    "moe_backend",
    "llm_args",
}


def recipes_root() -> Path:
    """The recipe folder: build_configs/, shipped in the package as `trtllm_dflash.build_configs`."""
    from trtllm_dflash.resources import package_dir

    return package_dir("build_configs")


def _preset_dirs() -> dict[str, Path]:
    root = recipes_root()
    return {p.name: p for p in sorted(root.iterdir()) if (p / MODEL_FILE).is_file()}


def _deployments(preset_dir: Path) -> dict[str, Path]:
    """Recipe name (`b200-throughput`, `h100`) -> file."""
    return {p.stem: p for p in sorted(preset_dir.glob("*.yaml")) if p.name != MODEL_FILE}


def presets() -> dict[str, list[str]]:
    """Every preset and its recipe ids, e.g. {"gpt-oss-120b": ["gpt-oss-120b/b200-latency", ...]}."""
    return {name: [f"{name}/{stem}" for stem in _deployments(d)] for name, d in _preset_dirs().items()}


def _read_yaml(path: Path, allowed: set[str]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DFlashError(f"{path}: not valid YAML ({e.__class__.__name__}).") from None
    if not isinstance(data, dict):
        raise DFlashError(f"{path}: expected a mapping at the top level.")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise DFlashError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}.")
    return data


# A preset's `draft:` keys: the architecture facts of the draft's config.json, under its names (DraftConfig's).
# The rest of DraftConfig (RoPE, norms, the round-trip extras) is the checkpoint's business: TensorRT-LLM reads it
# from the draft itself, and neither the layout checks nor the memory plan need it.
_DRAFT_KEYS = {*DRAFT_SIZES, "target_layer_ids", "mask_token_id", "layer_types", "sliding_window"}


def _facts(cls, raw: dict[str, Any], where: str, *, names: set[str] | None = None, layers: str = "num_layers"):
    """`cls(**raw)` with a sentence naming `where` for an unknown key (`names`: the allowed ones, by default
    every field) or a missing one; `layer_types_pattern` repeats over the `layers` count."""
    raw = dict(raw)
    pattern = raw.pop("layer_types_pattern", None)
    if pattern is not None:
        raw["layer_types"] = list(pattern) * (raw.get(layers, 0) // max(len(pattern), 1))
    names = names or {f.name for f in dataclasses.fields(cls)} - {"checkpoint_params"}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise DFlashError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(names))}.")
    try:
        return cls(**raw)
    except TypeError as e:
        raise DFlashError(f"{where}: {e}.") from None


def _split_name(stem: str) -> tuple[str, str | None]:
    gpu, _, profile = stem.partition("-")
    return gpu, profile or None


def load_recipe(model: str, gpu: str | None = None, profile: str | None = None) -> Recipe:
    """The recipe for preset `model` on `gpu` (default: the preset's) with `profile` (latency/throughput)."""
    dirs = _preset_dirs()
    if model not in dirs:
        raise DFlashError(f"Unknown model preset {model!r}; known presets: {', '.join(dirs)}.")
    preset_dir = dirs[model]
    meta = _read_yaml(preset_dir / MODEL_FILE, _MODEL_KEYS)
    defaults = meta.get("defaults") or {}
    deployments = _deployments(preset_dir)
    gpu = (gpu or defaults.get("gpu") or "").lower()
    on_gpu = {p: stem for stem in deployments for g, p in [_split_name(stem)] if g == gpu}
    if not on_gpu:
        raise DFlashError(f"{model} has no recipe for GPU {gpu!r}; available: {', '.join(deployments)}.")
    if profile is None:
        if len(on_gpu) == 1:
            profile = next(iter(on_gpu))
        elif defaults.get("profile") in on_gpu:
            profile = defaults["profile"]
        else:
            raise DFlashError(
                f"{model} on {gpu} has several profiles; choose one of: {', '.join(p for p in on_gpu if p)}."
            )
    if profile not in on_gpu:
        raise DFlashError(
            f"{model} on {gpu} has no {profile!r} profile; available: {', '.join(p or '(default)' for p in on_gpu)}."
        )
    stem = on_gpu[profile]
    path = deployments[stem]
    dep = _read_yaml(path, _DEPLOYMENT_KEYS)
    target = _facts(ModelFacts, meta.get("target") or {}, f"{preset_dir / MODEL_FILE}: target")
    raw_draft = dict(meta.get("draft") or {})
    draft_hf_id = raw_draft.pop("hf_id", None)
    draft = (
        _facts(
            DraftConfig,
            raw_draft,
            f"{preset_dir / MODEL_FILE}: draft",
            names=_DRAFT_KEYS,
            layers="num_hidden_layers",
        )
        if raw_draft
        else None
    )
    if gpu not in GPUS:
        raise DFlashError(f"{path}: unknown GPU {gpu!r}; known GPUs: {', '.join(sorted(GPUS))}.")
    return Recipe(
        id=f"{model}/{stem}",
        model=model,
        hf_id=meta["hf_id"],
        model_facts=target,
        draft_hf_id=draft_hf_id,
        draft_config=draft,
        gpu=gpu,
        num_gpus=dep.get("num_gpus", 1),
        parallel=_facts(Parallelism, dep.get("parallel") or {}, f"{path}: parallel"),
        quant=dep.get("quant", "none"),
        kv_cache_dtype=dep.get("kv_cache_dtype", "auto"),
        max_batch_size=dep.get("max_batch_size", 0),
        max_seq_len=dep.get("max_seq_len", 0),
        max_num_tokens=dep.get("max_num_tokens", 0),
        max_draft_len=dep.get("max_draft_len", 0),
        free_gpu_memory_fraction=float(dep.get("free_gpu_memory_fraction", 0.9)),
        cuda_graph_batch_sizes=tuple(dep.get("cuda_graph_batch_sizes") or ()),
        attn_backend=dep.get("attn_backend", "TRTLLM"),
        moe_backend=dep.get("moe_backend"),
        llm_args=dict(dep.get("llm_args") or {}),
        checkpoint=dep.get("checkpoint"),
        draft_acceptance=_acceptance(meta.get("draft_acceptance"), f"{preset_dir / MODEL_FILE}: draft_acceptance"),
        draft_training=_facts(DraftTraining, meta["draft_training"], f"{preset_dir / MODEL_FILE}: draft_training")
        if meta.get("draft_training")
        else None,
    )


def _acceptance(raw, where: str) -> tuple[float, int, str] | None:
    """model.yaml's `draft_acceptance: {tau, block_size, source}`: a published acceptance length and where from."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"tau", "block_size", "source"}:
        raise DFlashError(f"{where} must hold exactly tau, block_size and source.")
    tau, block, source = raw["tau"], raw["block_size"], raw["source"]
    if not isinstance(block, int) or block < 2 or not isinstance(tau, (int, float)) or not 1 <= tau <= block:
        raise DFlashError(f"{where}: tau must lie between 1 and block_size (an integer of 2 or more), got {raw}.")
    return float(tau), block, str(source)


# Combinations upstream shows no DFlash test of (NVIDIA/TensorRT-LLM tests/integration/defs/accuracy/
# test_llm_api_pytorch.py at 0a423022 and tests/unittest/_torch/speculative/hw_agnostic/test_dflash.py): no DFlash test
# enables attention-DP; FP8 KV caches are tested only with FP8 and NVFP4 checkpoints, never gpt-oss; every DFlash
# test but gpt-oss's turns KV block reuse off; gpt-oss's DFlash test runs the CUTLASS MoE backend, never TRITON on
# Hopper. The DFlash code refuses none of them, so they are untested rather than wrong: a build takes the tested
# choice unless the operator opts in, and says which it took.
OPT_INS = {
    "attention-dp": "attention data parallel (no upstream DFlash test enables it)",
    "fp8-kv": "an FP8 KV cache on a target that is not an FP8 or NVFP4 checkpoint (upstream tests DFlash with it only there)",
    "block-reuse": "KV block reuse (upstream's DFlash tests turn it off, gpt-oss's aside)",
    "triton-moe": "the TRITON MoE backend (upstream's gpt-oss DFlash test runs CUTLASS)",
}


def conservative(r: Recipe, opt_in: tuple[str, ...] = ()) -> tuple[Recipe, dict[str, str]]:
    """`r` with each untested DFlash combination replaced by the tested choice unless opted in; returns the recipe
    and, per replacement, its opt-in name and what was taken instead. The same holds for a --no-draft build, so
    that it stays the DFlash build's twin."""
    unknown = sorted(set(opt_in) - set(OPT_INS))
    if unknown:
        raise DFlashError(f"--opt-in takes {', '.join(OPT_INS)}; got {unknown[0]!r}.")
    notes, args = {}, dict(r.llm_args)
    if r.parallel.attention_dp and "attention-dp" not in opt_in:
        args.pop("attention_dp_config", None)
        r = dataclasses.replace(r, parallel=dataclasses.replace(r.parallel, attention_dp=False), llm_args=args)
        notes["attention-dp"] = "attention-DP off"
    if r.kv_cache_dtype == "fp8" and r.quant not in ("fp8", "nvfp4") and "fp8-kv" not in opt_in:
        r = dataclasses.replace(r, kv_cache_dtype="auto")
        notes["fp8-kv"] = "KV cache in the model's dtype, not FP8"
    if r.moe_backend == "TRITON" and "triton-moe" not in opt_in:
        r = dataclasses.replace(r, moe_backend="CUTLASS")
        notes["triton-moe"] = "MoE backend CUTLASS, not TRITON"
    if "block-reuse" not in opt_in:
        kv = dict(args.get("kv_cache_config") or {})
        kv.setdefault("enable_block_reuse", False)
        r = dataclasses.replace(r, llm_args={**r.llm_args, "kv_cache_config": kv})
        notes["block-reuse"] = "KV block reuse off"
    return r, notes


def is_gpu_preset(target: str) -> bool:
    """A preset's name, unless it names a local checkpoint: a folder that merely shares the name (a build output,
    as the README's `--output gpt-oss-120b/`) does not shadow the preset."""
    return target in presets() and not (Path(target).expanduser() / "config.json").is_file()
