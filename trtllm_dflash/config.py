"""Typed configuration, validated once at the edge; the rest of the code trusts it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trtllm_dflash.errors import DFlashError

DTYPE_CHOICES = ("auto", "fp32", "bf16")  # embedded backend; auto: the faster on this CPU (cpu.fastest_dtype)
DRAFT_LOSSES = ("decay", "dpace")  # train-draft slot weights: a fixed exp(-(k-1)/gamma), or D-PACE's dynamic ones
# adaptive: block length per row and step from measured costs and acceptance; planned: every row the draft length
# planned for the batch size (engine/plan.py, TensorRT-LLM's draft_len_schedule); fixed: always the full block
SPECULATION = ("adaptive", "planned", "fixed")

DRAFT_ARCHITECTURE = "DFlashDraftModel"
# DFlash2 drafts (block convolutions + a candidate selector) are served under the same `decoding_type: DFlash`; what
# makes one is read from the draft checkpoint (TensorRT-LLM tensorrt_llm/_torch/models/modeling_dflash.py @ad8349f6).
DFLASH2_STEM = "dflash2"  # matched in `architectures` ignoring case, "_" and "-": released drafts say DFlash2DraftModel
DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # in dflash_config
DFLASH2_CONVS = ("attention_conv", "mlp_conv")  # one per sublayer of every draft layer
DFLASH2_CODEBOOKS = ("predecessor_codebook", "successor_codebook")
LAYER_TYPES = ("full_attention", "sliding_attention")  # the attention kinds the draft and the memory plan know


def max_draft_len(block_size: int) -> int:
    """TensorRT-LLM's `max_draft_len` for a DFlash block: the block is the last committed token (the anchor) followed
    by the drafted slots, so a block of `block_size` drafts `block_size - 1` tokens."""
    return block_size - 1


def block_size_of(draft_len: int) -> int:
    """The block that drafts `draft_len` tokens (the inverse of max_draft_len)."""
    return draft_len + 1


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's default taps: one in the middle, or spread evenly over 1..N-3."""
    if num_taps == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_taps - 1)) for i in range(num_taps)]


def is_dflash2_architecture(architectures) -> bool:
    """An `architectures` entry that names a DFlash2 draft: upstream matches the "dflash2" stem, so per-target labels
    (DFlash2Qwen3ForCausalLM, dflash_2_draft_model) count too (modeling_dflash.py @ad8349f6,
    _is_dflash2_architecture)."""
    return any(
        DFLASH2_STEM in str(a).lower().replace("_", "").replace("-", "")
        for a in (architectures if isinstance(architectures, list) else [])
    )


def is_draft_architecture(architectures) -> bool:
    """A DFlash draft's config.json: DFlashDraftModel, or a DFlash2 draft's label."""
    return isinstance(architectures, list) and (
        DRAFT_ARCHITECTURE in architectures or is_dflash2_architecture(architectures)
    )


def attention_params(hidden: int, head_dim: int, q_heads: int, kv_heads: int) -> int:
    """q, k, v and o projections (biases and QK-norm weights are under 0.1% and left out)."""
    return hidden * head_dim * (2 * q_heads + 2 * kv_heads)


def gated_mlp_params(hidden: int, intermediate: int) -> int:
    """A SwiGLU MLP or one expert: gate, up and down projections."""
    return 3 * hidden * intermediate


def rope_of(text_config) -> dict:
    """A target config's RoPE settings in transformers 5 form (rope_parameters), legacy rope_theta folded in."""
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    rope.setdefault("rope_theta", getattr(text_config, "rope_theta", 1e4))
    return rope


# The sizes every draft is built from; each must be a positive integer however the draft is described.
DRAFT_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "block_size",
)


@dataclass
class DraftConfig:
    """A DFlash draft's config.json (z-lab format, read by TensorRT-LLM, vLLM and SGLang), and the one description
    of a draft's architecture: a checkpoint's config.json (from_dict), a fresh draft (for_target) and a GPU
    preset's `draft:` section (build_configs/*/model.yaml, under the same key names) all become one, checked in
    __post_init__ so that each way in fails with the same sentence.

    `mask_token_id` is None only for a preset whose draft's mask token no public source confirms: TensorRT-LLM
    reads dflash_config.mask_token_id from the draft checkpoint when it loads it, so the build never needs the
    number. A draft read from config.json always has one (from_dict requires it), and to_dict refuses to write
    a config.json without it.

    A DFlash2 draft (`is_dflash2`) adds per-layer block convolutions and a candidate selector, sized by four
    dflash_config entries (conv_kernel_size, conv_group_size, selector_rank, selector_top_k; None where the key is
    absent). TensorRT-LLM serves it under the same decoding_type and refuses a partial recipe at load time; the same
    rules run here, with its sentences, so a build fails before a GPU host does.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int | None
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    architectures: list[str] | None = None  # config.json's labels, kept for the round trip; None: [DRAFT_ARCHITECTURE]
    conv_kernel_size: int | None = None  # DFlash2: taps of each block convolution
    conv_group_size: int | None = None  # DFlash2: channels sharing one per-position kernel delta
    selector_rank: int | None = None  # DFlash2: rank of the candidate selector's codebooks
    selector_top_k: int | None = None  # DFlash2: candidates kept per block position (runtime only, no tensor)
    block_size_in_dflash_config: bool = False  # newer checkpoints keep it there; write it back where it was
    extra: dict[str, Any] = field(default_factory=dict)  # every other key, kept for a faithful round trip

    def __post_init__(self):
        for name in DRAFT_SIZES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DFlashError(f"The draft's {name} must be a positive integer, got {value!r}.")
        self.target_layer_ids = list(self.target_layer_ids)
        if not self.target_layer_ids:
            raise DFlashError("The draft has no target_layer_ids.")
        self.layer_types = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(
                f"The draft lists {len(self.layer_types)} layer types for {self.num_hidden_layers} layers."
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise DFlashError(f"The draft has an unknown layer type {bad[0]!r:.60}; known: {', '.join(LAYER_TYPES)}.")
        if self.architectures is not None:
            self.architectures = list(self.architectures)
        for name in DFLASH2_SIZES:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise DFlashError(f"The draft's dflash_config.{name} must be an integer, got {value!r:.40}.")
        if self.is_dflash2:
            self._check_dflash2()

    def _check_dflash2(self) -> None:
        """TensorRT-LLM's load-time rules for a DFlash2 draft, in its words (modeling_dflash.py @ad8349f6,
        _validate_dflash2_config and the conv shape checks; the d2t rule from speculative/dflash.py @10e95278): a
        partial recipe would silently run with DFlash 1 acceptance, so it is refused instead."""
        required = {name: getattr(self, name) or 0 for name in DFLASH2_SIZES}
        missing = sorted(name for name, value in required.items() if value < 1)
        if missing:
            raise DFlashError(f"DFlash 2 drafter is missing required dflash_config entries {missing}; got {required}.")
        if self.selector_top_k < 2:
            raise DFlashError(
                f"DFlash 2 selector_top_k={self.selector_top_k} leaves no candidates to choose between; it must be at "
                "least 2."
            )
        if self.hidden_size % self.conv_group_size:
            raise DFlashError(
                f"DFlash2 conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size}."
            )
        draft_vocab = self.extra.get("draft_vocab_size")
        if draft_vocab is not None and draft_vocab != self.vocab_size:
            raise DFlashError(
                "DFlash 2 candidate selection requires a shared draft/target vocab (d2t vocab mapping is not supported)."
            )

    @property
    def is_dflash2(self) -> bool:
        """Upstream's switch (modeling_dflash.py @ad8349f6): a DFlash2 architecture label, or a positive
        conv_kernel_size or selector_rank in dflash_config; there is no separate decoding_type."""
        return (
            (self.conv_kernel_size or 0) > 0
            or (self.selector_rank or 0) > 0
            or is_dflash2_architecture(self.architectures)
        )

    @property
    def dflash2_shapes(self) -> dict[str, tuple[int, ...]]:
        """A DFlash2 draft's tensors beyond DFlash 1's (none for a DFlash 1 draft), with the shapes TensorRT-LLM's
        loader checks (modeling_dflash.py @ad8349f6): per layer and sublayer a base kernel [2, taps, hidden] (side 0
        wraps the sublayer's input, side 1 its output) and the kernel_projection that drives both sides' per-position
        deltas, one per group of conv_group_size channels; and the selector's two codebooks over the draft vocabulary
        with the projection of the hidden state into their rank."""
        if not self.is_dflash2:
            return {}
        h, taps = self.hidden_size, self.conv_kernel_size
        out: dict[str, tuple[int, ...]] = {}
        for i in range(self.num_hidden_layers):
            for conv in DFLASH2_CONVS:
                out[f"layers.{i}.{conv}.base_kernel"] = (2, taps, h)
                out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * h // self.conv_group_size, h)
        for book in DFLASH2_CODEBOOKS:
            out[f"candidate_selector.{book}"] = (self.vocab_size, self.selector_rank)
        out["candidate_selector.hidden_projection.weight"] = (self.selector_rank, h)
        return out

    @property
    def dflash2_params(self) -> int:
        """Parameters of the DFlash2 convolutions and candidate selector (0 for a DFlash 1 draft)."""
        return sum(math.prod(shape) for shape in self.dflash2_shapes.values())

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 1e4))

    def layer_is_causal(self, i: int) -> bool:
        """SWA layers are causal inside the block unless the config says otherwise (z-lab, vLLM)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def trtllm_noncausal_window(self) -> tuple[int, int] | None:
        """(layer, window) of the first draft layer TensorRT-LLM attends non-causally within a finite sliding window,
        or None. It reads a layer as modeling_dflash.py @ad8349f6 (_get_attention_mask_args) does: the top-level
        is_causal counts for a DFlash2 draft only, and otherwise a windowed (sliding) layer is causal, so only a DFlash2
        draft such as the released all-sliding, is_causal false ones has such a layer."""
        for i in range(self.num_hidden_layers):
            window = self.layer_window(i)
            if window is not None and self.is_dflash2 and not self.layer_is_causal(i):
                return i, window
        return None

    @property
    def param_count(self) -> int:
        """Draft layers + `fc` (concatenated target features -> hidden) + hidden_norm + final norm, and a DFlash2
        draft's convolutions and selector codebooks; no embedding or LM head (the draft uses the target's)."""
        per_layer = (
            attention_params(self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads)
            + gated_mlp_params(self.hidden_size, self.intermediate_size)
            + 2 * self.hidden_size
        )
        fc = len(self.target_layer_ids) * self.hidden_size * self.hidden_size
        return self.num_hidden_layers * per_layer + fc + 2 * self.hidden_size + self.dflash2_params

    @property
    def short_blocks(self) -> float:
        """The share of training blocks cut to a random shorter width (train-draft --short-blocks; 0: none): a draft
        so trained guesses as well from a block's first k + 1 slots as from all of them, so a block of k tokens is
        drafted over k + 1 slots alone (propose.py). Kept in dflash_config, beside z-lab's optional keys."""
        return float(self.extra.get("dflash_config", {}).get("short_blocks") or 0.0)

    @classmethod
    def for_target(
        cls,
        text_config,
        *,
        vocab_rows: int,
        num_layers: int = 2,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
    ) -> DraftConfig:
        """A fresh draft shaped after the target's own layers (width, heads, RoPE), as z-lab drafts are."""
        n_target = text_config.num_hidden_layers
        rope = {"rope_type": "default", **rope_of(text_config)}
        return cls(
            hidden_size=text_config.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=text_config.num_attention_heads,
            num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads,
            head_dim=getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads,
            intermediate_size=text_config.intermediate_size,
            vocab_size=vocab_rows,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=target_layer_ids or build_target_layer_ids(n_target, num_layers),
            num_target_layers=n_target,
            rms_norm_eps=float(getattr(text_config, "rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 32768)),
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DraftConfig:
        from transformers import Qwen3Config

        raw = dict(raw)
        dflash = dict(raw.get("dflash_config") or {})
        if "mask_token_id" not in dflash:
            raise DFlashError(
                "The draft's config.json has no dflash_config.mask_token_id; it is not a DFlash draft checkpoint."
            )
        short = dflash.get("short_blocks")
        if short is not None and (
            isinstance(short, bool) or not isinstance(short, (int, float)) or not 0 <= short <= 1
        ):
            raise DFlashError(
                f"The draft's config.json sets dflash_config.short_blocks to {json.dumps(short)[:40]}, not a share "
                "from 0 to 1 (train-draft --short-blocks)."
            )
        in_dflash = "block_size" in dflash
        block_size = dflash.get("block_size", raw.get("block_size"))
        if block_size is None:
            raise DFlashError("The draft's config.json has no block_size (top level or in dflash_config).")
        # Qwen3Config normalises legacy rope_theta/rope_scaling into rope_parameters. layer_types is read from raw
        # and checked against the layer count in __post_init__, with the same sentence as a preset's draft.
        skip = ("dflash_config", "architectures", "auto_map", "model_type", "layer_types")
        std = Qwen3Config(**{k: v for k, v in raw.items() if k not in skip})
        n_layers = std.num_hidden_layers
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if raw.get("num_target_layers") is None:
                raise DFlashError(
                    "The draft's config.json has neither dflash_config.target_layer_ids nor num_target_layers."
                )
            layer_ids = build_target_layer_ids(int(raw["num_target_layers"]), n_layers)
        known = {
            *DRAFT_SIZES,
            "dflash_config",
            "num_target_layers",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "max_position_embeddings",
            "attention_bias",
            "layer_types",
            "sliding_window",
            "is_causal",
            "architectures",
            "model_type",
        }
        extra = {k: v for k, v in raw.items() if k not in known}
        extra["dflash_config"] = {
            k: v
            for k, v in dflash.items()
            if k not in ("mask_token_id", "target_layer_ids", "block_size", *DFLASH2_SIZES)
        }
        archs = raw.get("architectures")
        head_dim = raw.get("head_dim") or std.hidden_size // std.num_attention_heads
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            hidden_size=std.hidden_size,
            num_hidden_layers=n_layers,
            num_attention_heads=std.num_attention_heads,
            num_key_value_heads=std.num_key_value_heads,
            head_dim=int(head_dim),
            intermediate_size=std.intermediate_size,
            vocab_size=std.vocab_size,
            block_size=int(block_size),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=raw.get("num_target_layers"),
            rms_norm_eps=float(std.rms_norm_eps),
            rope_parameters=dict(std.rope_parameters),
            max_position_embeddings=std.max_position_embeddings,
            attention_bias=bool(std.attention_bias),
            layer_types=list(raw["layer_types"]) if raw.get("layer_types") else None,
            sliding_window=sliding,
            is_causal=raw.get("is_causal"),
            architectures=list(archs) if isinstance(archs, list) else None,
            **{name: dflash[name] for name in DFLASH2_SIZES if name in dflash},
            block_size_in_dflash_config=in_dflash,
            extra=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        if self.mask_token_id is None:
            raise DFlashError(
                "This draft has no mask_token_id (a preset's facts, not a checkpoint's); it cannot be written as a "
                "config.json."
            )
        rope_scaling = (
            None
            if self.rope_parameters.get("rope_type", "default") == "default"
            else {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        )
        dflash = dict(self.extra.get("dflash_config", {}))
        dflash.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        dflash.update({name: getattr(self, name) for name in DFLASH2_SIZES if getattr(self, name) is not None})
        out = {k: v for k, v in self.extra.items() if k != "dflash_config"}
        out.update(
            architectures=list(self.architectures or [DRAFT_ARCHITECTURE]),
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act="silu",
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,  # older readers (transformers 4.x) look here
            rope_scaling=rope_scaling,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            layer_types=list(self.layer_types),
            use_sliding_window=self.sliding_window is not None,
            sliding_window=self.sliding_window,
            tie_word_embeddings=False,
            dflash_config=dflash,
        )
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.block_size_in_dflash_config:
            dflash["block_size"] = self.block_size
        else:
            out["block_size"] = self.block_size
        return out


def check_speculation(value: str) -> None:
    if value not in SPECULATION:
        raise DFlashError(f"--speculation must be one of {', '.join(SPECULATION)}, got {value!r}.")


def check_prefix_cache_tokens(value: int) -> None:
    if value < 0:
        raise DFlashError(f"--prefix-cache-tokens must be 0 (off) or more, got {value}.")


ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded")  # Dynamo frontend --router-mode values a fleet takes
ENGINE_FILE = "engine.json"  # beside the embedded engine model's config.pbtxt in a built repository


WEIGHTS = ("auto", "bf16")  # auto: a target's 4-bit weights multiplied as shipped where this CPU's kernel takes them
# (bf16 compute, the same bits as its bf16 weights: models/gguf4.py, kernels/q4_blocks.h); bf16: always the bf16 weights


@dataclass(frozen=True)
class EngineOptions:
    """How a built repository's embedded engine runs: chosen once by `build`, written as JSON into the repository
    (ENGINE_FILE, as a TensorRT-LLM deployment's LLM-API options are model.yaml) and read back typed by the Triton
    model, so no option is re-typed or parsed from a string between the two.

    Invariants: `dtype` is resolved (fp32 or bf16); `block_size` >= 1, and 1 where `draft_dir` is "" (no draft);
    `speculation` is one of SPECULATION; `prefix_cache_tokens` >= 0; paths are relative to the engine model's
    directory."""

    target_dir: str
    draft_dir: str  # "" = no draft (autoregressive)
    dtype: str
    block_size: int
    speculation: str  # block length per step: one of SPECULATION
    lookup: bool  # prompt-lookup guesses where a request's text repeats (engine/lookup.py)
    int8_draft: bool  # bf16 on AVX2 alone: the draft's weights as int8 (DFlashEngine.load)
    prefix_cache_tokens: int  # prompt tokens whose K/V the engine keeps for later prompts (engine/prefix_cache.py)
    weights: str = "auto"  # one of WEIGHTS: the target's 4-bit weights as shipped where the kernel takes them

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            kind = {"str": str, "int": int, "bool": bool}[f.type]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise DFlashError(f"Engine option {f.name} must be of type {f.type}, got {json.dumps(value)[:40]}.")
        if self.dtype not in DTYPE_CHOICES[1:]:
            raise DFlashError(f"Engine option dtype must be one of {', '.join(DTYPE_CHOICES[1:])}, got {self.dtype!r}.")
        check_speculation(self.speculation)
        check_prefix_cache_tokens(self.prefix_cache_tokens)
        if self.weights not in WEIGHTS:
            raise DFlashError(f"Engine option weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}.")
        if self.block_size < 1 or (self.block_size > 1 and not self.draft_dir):
            raise DFlashError(f"Engine option block_size {self.block_size} does not fit draft_dir {self.draft_dir!r}.")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> EngineOptions:
        """Options as `to_json` wrote them; anything else is one sentence naming `where`."""
        try:
            raw = json.loads(text)
        except ValueError:
            raise DFlashError(f"{where} is not JSON; rebuild the repository with `trtdflash build`.") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) != names:
            got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
            raise DFlashError(f"{where} holds {got}, not the engine options {sorted(names)}; rebuild the repository.")
        return cls(**raw)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DFlashError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if not (0 < self.top_p <= 1):
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise DFlashError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise DFlashError(f"seed must be in [0, 2^64), got {self.seed}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
