"""The target: any Hugging Face causal LM, with hidden-state taps and a static per-slot KV cache."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from trtllm_dflash.config import rope_of
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.kernels.packed import PackedLinear, pack_linears
from trtllm_dflash.models.gguf4 import takes_four_bit
from trtllm_dflash.models.quantized import load_quantized_lm, read_quant_spec

RECURRENT_HINTS = ("mamba", "rwkv", "recurrent", "linear_attention", "gated_deltanet", "xlstm")
# Families whose HF decoder layer is exactly the one `_lean_forward` runs: pre-norm RMSNorm, q/k/v/o projections
# (Qwen3: per-head q/k RMSNorm), rotate-half RoPE, full causal attention, gated SiLU MLP, no embedding scale.
LEAN_FAMILIES = ("llama", "qwen2", "qwen3")
STEP_QUERIES = 32  # queries per row up to which a bf16 forward attends with our kernel (a step's rows: a block at most)


def _rows_sdpa(query, key, value, attention_mask, scaling):
    """Attention of few queries per row: two batched matmuls, each K/V head shared by its query group (HF's repeat_kv
    order: query head h reads K/V head h // groups); a third of SDPA's CPU kernel at these shapes.
    query [n, H, kmax, hd], key/value [n, nkv, K, hd], attention_mask [n, 1, kmax, K] or None -> [n, kmax, H, hd]."""
    (n, heads, kmax, hd), (_, nkv, length, _) = query.shape, key.shape
    groups = heads // nkv
    q = query.reshape(n, nkv, groups * kmax, hd)
    scores = torch.matmul(q, key.transpose(-1, -2)).view(n, nkv, groups, kmax, length).float() * scaling
    if attention_mask is not None:  # None: one row of one token, which sees its whole slot
        scores = scores + attention_mask[:, :, None].float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(n, nkv, groups * kmax, length)
    return torch.matmul(probs, value).view(n, nkv, groups, kmax, hd).permute(0, 3, 1, 2, 4).reshape(n, kmax, heads, hd)


class FlatRows:
    """Rows of different lengths on one flat token axis [T] (vLLM's layout), row i being cache slot i.

    Attention gathers each row's queries into [n, kmax] (a short row's pads repeat its last token), unless few rows
    are long (a step where one or two requests draft beside plainly decoding ones): then every row's first token
    attends in one batch and each long row's other tokens on their own, as TensorRT-LLM runs generation and context
    requests apart. With few long rows that is cheaper than padding every row; with more long rows than a quarter,
    padding is as cheap or cheaper (docs/performance.md#flat-rows)."""

    def __init__(self, lengths: list[int]):
        n, lens = len(lengths), torch.tensor(lengths)
        self.kmax, offsets = max(lengths), torch.cumsum(lens, 0) - lens
        self.col = torch.minimum(torch.arange(self.kmax)[None], lens[:, None] - 1)  # [n, kmax]
        self.pad_index = offsets[:, None] + self.col  # [n, kmax] -> flat token index
        self.flat_row = torch.repeat_interleave(torch.arange(n), lens)  # [T]
        self.flat_col = torch.arange(int(lens.sum())) - offsets[self.flat_row]
        self.first = offsets  # [n] flat index of each row's first token
        long = [(i, int(offsets[i]), k) for i, k in enumerate(lengths) if k > 1]
        self.long = long if len(long) <= n // 4 else None  # (row, flat offset, length); None: all rows padded


def _flat_rows_sdpa(query, key, value, attention_mask, scaling, rows: FlatRows):
    """query [H, T, hd] on the flat axis, key/value [n, nkv, K, hd], attention_mask [n, 1, kmax, K] -> [T, H, hd]."""
    if rows.long is None:
        q = query[:, rows.pad_index].transpose(0, 1)  # [n, H, kmax, hd]
        return _rows_sdpa(q, key, value, attention_mask, scaling)[rows.flat_row, rows.flat_col]
    out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
    first = query[:, rows.first].transpose(0, 1)[:, :, None]  # [n, H, 1, hd]
    out[rows.first] = _rows_sdpa(first, key, value, attention_mask[:, :, :1], scaling)[:, 0]
    for i, offset, k in rows.long:
        q = query[None, :, offset + 1 : offset + k]  # [1, H, k-1, hd]
        out[offset + 1 : offset + k] = _rows_sdpa(
            q, key[i : i + 1], value[i : i + 1], attention_mask[i : i + 1, :, 1:k], scaling
        )[0]
    return out


def _gated(act_fn, sizes: list[int]):
    """A gated MLP's activation of its fused gate/up output: act(gate) * up."""

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(sizes, dim=-1)
        return act_fn(gate) * up

    return act


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rows_attention(inner_name: str):
    """The model's own attention (`inner_name`), and for a forward of rows laid on one flat token axis (`slot_rows`),
    the same per row: the flat queries [1, H, T, hd] are gathered into [n, H, kmax, hd] (a short row's pads repeat its
    last token), attend to their own slot's K/V [n, nkv, K, hd] under the per-row mask, and go back to the flat axis.
    Linear layers never see a pad. Quantized targets keep their batch-invariant attention this way."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[inner_name]

    def attention(module, query, key, value, attention_mask, slot_rows: FlatRows | None = None, **kwargs):
        if slot_rows is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        if inner_name == "sdpa":
            scaling = kwargs.get("scaling")
            return _flat_rows_sdpa(
                query[0],
                key,
                value,
                attention_mask,
                scaling if scaling is not None else query.shape[-1] ** -0.5,
                slot_rows,
            )[None], None  # [1, T, H, hd]
        q = query[0][:, slot_rows.pad_index].transpose(0, 1)  # [n, H, kmax, hd]
        out, _ = inner(module, q.contiguous(), key, value, attention_mask, **kwargs)
        return out[slot_rows.flat_row, slot_rows.flat_col][None], None

    return attention


class _FusedOutputs:
    """The output of one GEMM over projections that read the same input (q/k/v, gate/up), split per projection: HF's
    layers call each projection with the same tensor, so the first call computes them all and the others take their
    slice. Forgotten once every slice is taken, so no layer's activations outlive its forward."""

    def __init__(self, owner: nn.Module, name: str, sizes: list[int]):
        self.owner, self.name, self.sizes = owner, name, sizes
        self.x, self.out, self.untaken = None, (), set()

    def take(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self.x:  # the same tensor object (inference tensors carry no version counter to check further)
            self.x, self.out, self.untaken = (
                x,
                getattr(self.owner, self.name)(x).split(self.sizes, dim=-1),
                set(range(len(self.sizes))),
            )
        out = self.out[index]
        self.untaken.discard(index)
        if not self.untaken:
            self.x, self.out = None, ()
        return out


class ProjectionSlice(nn.Module):
    """Stands in for a projection fused into a wider one (q_proj in qkv_proj): its slice of the fused output."""

    def __init__(self, outputs: _FusedOutputs, index: int):
        super().__init__()
        self.outputs, self.index = outputs, index
        self.out_features = outputs.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outputs.take(x, self.index)


FUSED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


@torch.no_grad()
def fuse_projections(layers: nn.ModuleList) -> None:
    """Concatenate each layer's q/k/v and gate/up weights into one linear (`qkv_proj`, `gate_up_proj`): one GEMM
    instead of three and two. Each output column is its own dot product, so the values are the projections' own
    (bit-identical in fp32 and bf16 on oneDNN; docs/performance.md#fused-projections). The old modules become slices
    of it."""
    for layer in layers:
        for child, fused, names in FUSED:
            owner = getattr(layer, child)
            parts = [getattr(owner, n) for n in names]
            if any(type(p) is not nn.Linear for p in parts) or len({p.bias is None for p in parts}) > 1:
                continue
            # On the meta device: a real one would first draw random weights (kaiming) only to drop them, a large
            # share of a load (docs/performance.md#fuse-on-meta).
            linear = nn.Linear(
                parts[0].in_features,
                sum(p.out_features for p in parts),
                bias=parts[0].bias is not None,
                device="meta",
                dtype=parts[0].weight.dtype,
            )
            linear.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
            if linear.bias is not None:
                linear.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
            setattr(owner, fused, linear)
            outputs = _FusedOutputs(owner, fused, [p.out_features for p in parts])
            for i, name in enumerate(names):
                setattr(owner, name, ProjectionSlice(outputs, i))


@torch.no_grad()
def use_four_bit(model: nn.Module, path: Path) -> int:
    """Every packed bf16 linear of `model` whose weights the folder's GGUF holds in 4 bits (a fused one: all its
    parts) multiplies those (PackedLinear.use_q4); returns how many. The LM head and any other tensor without a 4-bit
    form keep bf16."""
    from trtllm_dflash.models.gguf4 import GGUF_FILE, read_codes

    codes = read_codes(path / GGUF_FILE)
    fused = {name: parts for _, name, parts in FUSED}
    used = 0
    for name, module in model.named_modules():
        if not isinstance(module, PackedLinear) or module.kernel is None or module.scale is not None or module.tiled:
            continue
        owner, _, leaf = name.rpartition(".")
        parts = [f"{owner}.{p}.weight" for p in fused.get(leaf, (leaf,))]
        if all(p in codes and codes[p].q.shape[0] % bf16_gemm.BLOCK == 0 for p in parts):
            module.use_q4(torch.cat([bf16_gemm.pack_q4(codes[p]) for p in parts]))
            used += 1
    return used


class TargetModel:
    """Wraps an HF causal LM; `forward` returns logits and the features of the tapped layers.

    Layer id l is the *output* of decoder layer l (HF hidden_states[l + 1]); captured with forward
    hooks so no other layer's states are kept.
    """

    def __init__(self, model: nn.Module, tokenizer, path: Path):
        self.model = model
        self.tokenizer = tokenizer
        self.four_bit = 0  # linears multiplying 4-bit weights (load: use_four_bit)
        self.path = path
        self.config = model.config
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.text_config = text_cfg
        self.layers = model.get_decoder().layers
        self.num_layers = len(self.layers)
        self.embed_tokens = model.get_input_embeddings()
        self.hidden_size = self.embed_tokens.weight.shape[1]
        self.vocab_rows = self.embed_tokens.weight.shape[0]
        self.max_positions = int(getattr(text_cfg, "max_position_embeddings", 0) or 1 << 30)
        self.dtype = self.embed_tokens.weight.dtype
        self._taps: list[int] = []
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self._capture = False
        self.ragged = self._use_ragged_attention()
        self.lean = self._lean_supported()
        if self.lean:  # the lean loop runs the fused projections (the HF forward their slices)
            fuse_projections(self.layers)
            self.lean = all(hasattr(l.self_attn, "qkv_proj") and hasattr(l.mlp, "gate_up_proj") for l in self.layers)
        self.attention = self._attention_kernel()  # used by the lean loop only: decided once it is known
        # ... and its RMSNorm, in every forward of the lean loop, so a prompt's tokens and a step's are normed alike
        self.rms_kernel = self.attention if self.attention is not None and self.hidden_size % 16 == 0 else None
        # ... and its MLP activation, silu(gate) * up in one call (activation.h)
        self.mlp_kernel = (
            self.rms_kernel if self.rms_kernel is not None and self.text_config.intermediate_size % 16 == 0 else None
        )
        self._plan: tuple[list[tuple], Callable] | None = (
            None  # the lean loop's callables (`_layer_plan`), bound at its first run
        )
        self._fused: tuple[list[tuple] | None, int] = (
            None,
            0,
        )  # ... and a step's layers as one kernel call each (`_fused_layers`)

    def _use_ragged_attention(self) -> bool:
        """Wrap the model's attention so `forward_rows` can lay rows on one flat axis; True where it could (HF models
        that dispatch through ALL_ATTENTION_FUNCTIONS and a registered implementation: SDPA, our quantized one).
        Elsewhere `forward_rows` pads rows to one length."""
        # transformers.modeling_utils imports triton: not at our import time (the kernel tests set the interpreter first)
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = getattr(self.model.config, "_attn_implementation", None)
        if isinstance(inner, str) and inner.startswith("slot_rows_"):
            return True  # wrapped by an earlier TargetModel of the same model
        if inner not in ALL_ATTENTION_FUNCTIONS or inner not in ALL_MASK_ATTENTION_FUNCTIONS:
            return False
        name = f"slot_rows_{inner}"  # no "flash" in it: transformers routes those names to hub kernels
        AttentionInterface.register(name, _rows_attention(inner))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])  # other forwards: masks as before
        try:
            self.model.set_attn_implementation(name)
        except (ValueError, ImportError, AttributeError, NotImplementedError):
            return False
        return self.model.config._attn_implementation == name

    def _attention_kernel(self):
        """Our bf16 kernel module where it runs (bf16_gemm.py), for `attend` (slot_attention.h): a bf16 step's
        attention, one fixed order per token, so a decode step, a verify block and a batch of rows agree bit for bit."""
        from trtllm_dflash.kernels import bf16_gemm

        head_dim = getattr(self.layers[0].self_attn, "head_dim", 0) if self.lean else 0
        kernel = bf16_gemm.kernel() if self.dtype == torch.bfloat16 and head_dim else None
        return kernel if kernel is not None and head_dim in kernel.ATTEND_HEAD_DIMS else None

    def _lean_supported(self) -> bool:
        """Whether `_lean_forward` computes what the HF forward does for this model: a listed family, full attention
        on every layer, SiLU, SDPA attention (quantized targets keep their own)."""
        text = self.text_config
        decoder = self.model.get_decoder()
        return (
            getattr(text, "model_type", None) in LEAN_FAMILIES
            and self._mask_rules() == {"": None}
            and getattr(text, "hidden_act", "silu") == "silu"
            and self.ragged
            and self.model.config._attn_implementation == "slot_rows_sdpa"
            and all(hasattr(decoder, n) for n in ("embed_tokens", "rotary_emb", "norm"))
        )

    @classmethod
    def load(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, pack: bool = True, weights: str = "auto"
    ) -> TargetModel:
        """`pack`: prepack the linear layers for oneDNN (kernels/packed.py); off where weights are trained or exported.
        `weights` "auto": where the folder keeps 4-bit weights as shipped (models/gguf4.py) and this CPU's kernel
        multiplies them (bf16_gemm.q4_weights), bf16 linears multiply those instead, with the same bits; "bf16": never."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from trtllm_dflash.untrusted import check_checkpoint_dir, read_hf_config

        check_checkpoint_dir(path, "Target")  # headers, config ranges, symlinks: before transformers opens a file
        hf_logging.disable_progress_bar()
        path = Path(path)
        config = read_hf_config(path, "Target")  # never trust_remote_code implicitly
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kinds = " ".join(
            [str(getattr(text, "model_type", ""))] + [str(t) for t in (getattr(text, "layer_types", None) or [])]
        ).lower()
        if any(h in kinds for h in RECURRENT_HINTS):
            raise DFlashError(
                f"Target {path} ({text.model_type}) has recurrent/linear-attention layers whose state cannot be cropped "
                "after a rejected draft; only attention-only targets are supported for now."
            )
        try:
            spec = read_quant_spec(path)
            model = (
                load_quantized_lm(path, config, spec, dtype)
                if spec is not None
                else AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
            )
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (ValueError, OSError) as e:
            raise DFlashError(f"Could not load target {path}: {str(e).splitlines()[0]}") from None
        model.eval().requires_grad_(False)
        target = cls(model, tokenizer, path)  # fuses projections where the lean forward runs: before packing
        if pack:
            pack_linears(model, keep=(model.get_output_embeddings(),))
            if takes_four_bit(path, "bf16" if dtype == torch.bfloat16 else "fp32", weights):
                target.four_bit = use_four_bit(model, path)
        return target

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()  # untied heads exist (Qwen2.5 GGUFs); packing swaps the module

    @property
    def rope_parameters(self) -> dict:
        return rope_of(self.text_config)

    def set_taps(self, layer_ids: list[int]) -> None:
        """Register hooks on the decoder layers whose outputs the draft reads."""
        for h in self._hooks:
            h.remove()
        self._taps = list(layer_ids)
        self._hooks = [self.layers[l].register_forward_hook(self._make_hook(l)) for l in set(layer_ids)]

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self._capture:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def new_cache(self, slots: int = 1, capacity: int = 256) -> SlotKVCache:
        return SlotKVCache(slots, capacity)

    @contextmanager
    def _capturing(self, enabled: bool):
        """Record the tapped layers' outputs in the forwards inside; yields `features()` -> [b, T, n_sel*H] of the last one, or None."""
        self._capture = enabled and bool(self._taps)
        try:
            yield lambda: torch.cat([self._captured[l] for l in self._taps], dim=-1) if self._capture else None
        finally:
            self._capture = False
            self._captured.clear()

    @contextmanager
    def tapped(self, layer_ids: list[int]):
        """Capture `layer_ids` in forwards run outside `forward` (the data phase's own loop); the taps are restored after."""
        previous = self._taps
        self.set_taps(layer_ids)
        try:
            with self._capturing(True) as features:
                yield features
        finally:
            self.set_taps(previous)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start,
        cache: SlotKVCache,
        capture: bool,
        logits_to_keep: int = 0,
        first_slot: int = 0,
    ):
        """input_ids [b, T] -> logits [b, T|keep, V], features [b, T, n_sel*H] or None.

        Row i is cache slot first_slot + i and its tokens sit at positions start[i]..start[i]+T-1 (`start` an int
        for all rows, or a list). K/V are written in place at those positions; whatever a slot holds at or past a
        row's start is overwritten, which is how rejected drafts are rolled back.
        """
        b, t = input_ids.shape
        starts = torch.tensor([start] * b if isinstance(start, int) else start)
        positions = starts[:, None] + torch.arange(t)  # [b, T]
        masks = cache.begin(first_slot, positions, self._mask_rules(), self.dtype)
        if self.lean:
            return self._lean_forward(input_ids, positions, cache, masks, capture, logits_to_keep)
        with self._capturing(capture) as features:
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                past_key_values=cache,
                attention_mask=masks,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
            return out.logits, features()

    @torch.inference_mode()
    def forward_rows(self, rows: list[list[int]], starts: list[int], cache: SlotKVCache, capture: bool):
        """Rows of different lengths in one forward (vLLM's flat token axis): row i is cache slot i, its tokens at
        positions starts[i]... Returns logits [T, V] and features [T, n_sel*H] or None, T = the rows' tokens in order."""
        if len({len(r) for r in rows}) == 1:  # rows of one length: the dense forward, no gathers
            logits, feats = self.forward(torch.tensor(rows), starts, cache, capture)
            return logits.flatten(0, 1), None if feats is None else feats.flatten(0, 1)
        flat = FlatRows([len(r) for r in rows])
        ids = torch.tensor([t for r in rows for t in r])
        if not self.ragged:  # every row padded to kmax: the pads' K/V land past the row's start, where stale K/V may be
            logits, feats = self.forward(ids[flat.pad_index], starts, cache, capture)
            return logits[flat.flat_row, flat.flat_col], None if feats is None else feats[flat.flat_row, flat.flat_col]
        positions = torch.tensor(starts)[:, None] + flat.col  # [n, kmax]
        masks = cache.begin(0, positions, self._mask_rules(), self.dtype, flat)
        flat_positions = positions[flat.flat_row, flat.flat_col][None]
        if self.lean:
            logits, feats = self._lean_forward(ids[None], flat_positions, cache, masks, capture, slot_rows=flat)
            return logits[0], None if feats is None else feats[0]
        with self._capturing(capture) as features:
            out = self.model(
                input_ids=ids[None],
                position_ids=flat_positions,
                past_key_values=cache,
                attention_mask=masks,
                use_cache=True,
                slot_rows=flat,
            )
            feats = features()
            return out.logits[0], None if feats is None else feats[0]

    def _lean_forward(
        self, input_ids, positions, cache: SlotKVCache, masks, capture: bool, logits_to_keep: int = 0, slot_rows=None
    ):
        """The decoder as one loop over its layers, calling the model's own modules: what HF's forward computes,
        without its per-layer dispatch, output capture and mask plumbing (on a 2-core CPU that was about a fifth of a
        135M target's 8-token verify). input_ids/positions [b, T] (flat rows: [1, T] with `slot_rows`) -> logits,
        features [b, T, n_sel*H] or None."""
        decoder = self.model.get_decoder()
        # a step's few queries per row take our kernel: each token over its slot up to its position (a prompt's long
        # chunks keep SDPA, the same in every mode, so DFlash and plain decoding start from the same cache)
        step = (
            self.attention is not None
            and (slot_rows.kmax if slot_rows is not None else input_ids.shape[1]) <= STEP_QUERIES
        )
        if step:
            b, t = input_ids.shape
            token_slot = (
                slot_rows.flat_row if slot_rows is not None else cache.first_slot + torch.arange(b).repeat_interleave(t)
            )
            token_pos = positions.reshape(-1)
        x = decoder.embed_tokens(input_ids)  # [b, T, H]
        cos, sin = decoder.rotary_emb(x, positions)  # [b, T, hd]
        if step:
            token_cos, token_sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])  # [b*T, hd]
        cos, sin = cos[:, None], sin[:, None]  # [b, 1, T, hd]: broadcast over heads
        taps = set(self._taps) if capture else ()
        captured = {}
        layers, final_norm = self._layer_plan()
        lead = (-1,) if step else x.shape[:-1]  # a step's tokens on one axis, [b*T], for the kernel; else [b, T]
        fused, max_tokens = self._fused if step else (None, 0)
        if fused is not None and token_pos.numel() <= max_tokens:  # a step's layers as one kernel call each
            for i, (kv_heads, head_dim, pre, post) in enumerate(fused):
                keys, values = cache.buffers(i, kv_heads, head_dim, x.dtype)
                x = self.attention.decoder_step(
                    x, *pre, token_cos, token_sin, keys, values, token_slot, token_pos, *post
                )
                if i in taps:
                    captured[i] = x
        else:
            for i, (norm1, qkv, sizes, qk_norm, head_dim, scaling, o_proj, norm2, gate_up, act, down) in enumerate(
                layers
            ):
                # one view, then the heads split (Tensor.split's Python wrapper and a view per piece cost a bf16 step 1.4-5.2 %)
                heads = qkv(norm1(x)).view(*lead, sum(sizes) // head_dim, head_dim)
                q, k, v = heads.split_with_sizes([n // head_dim for n in sizes], -2)
                if qk_norm is not None:  # Qwen3: RMSNorm per head before RoPE
                    q, k = qk_norm[0](q), qk_norm[1](k)
                if step:  # RoPE, the cache writes and attention in one call: the same bits as the ops below (slot_attention.h)
                    keys, values = cache.buffers(i, k.shape[-2], head_dim, k.dtype)
                    out = self.attention.rope_attend(
                        q, k, v, token_cos, token_sin, keys, values, token_slot, token_pos, scaling
                    )  # [b*T, heads*hd]
                else:
                    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, T, hd]
                    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
                    keys, values = cache.update(k, v, i)  # this forward's rows' K/V [b | n, nkv, K, hd]
                    if (
                        slot_rows is None and q.shape[0] == 1 and (q.shape[2] > 1 or masks is None)
                    ):  # not one query over a whole slot
                        if (
                            q.shape[2] == 1 and q.dtype == torch.bfloat16
                        ):  # decoding one row: the K/V slice taken to fp32 and SDPA's fp32 kernel beat any bf16
                            # attention; with 8 queries, or several rows, the bf16 kernels are as fast or faster
                            # (docs/performance.md#one-row-fp32-attention)
                            out = (
                                F.scaled_dot_product_attention(
                                    q.float(),
                                    keys.float(),
                                    values.float(),
                                    scale=scaling,
                                    enable_gqa=q.shape[1] != keys.shape[1],
                                )
                                .to(q.dtype)
                                .transpose(1, 2)
                            )
                        else:
                            out = F.scaled_dot_product_attention(
                                q, keys, values, attn_mask=masks, scale=scaling, enable_gqa=q.shape[1] != keys.shape[1]
                            ).transpose(1, 2)
                    elif (
                        slot_rows is None
                    ):  # rows of one length: SDPA's CPU kernel under a per-row mask cost 1.2x the step
                        out = _rows_sdpa(q, keys, values, masks, scaling)
                    else:
                        out = _flat_rows_sdpa(q[0], keys, values, masks, scaling, slot_rows)[None]
                x = x + o_proj(out.reshape(*x.shape[:-1], -1))
                x = x + down(act(gate_up(norm2(x))))
                if i in taps:
                    captured[i] = x
        h = final_norm(x[:, -logits_to_keep:] if logits_to_keep else x)
        feats = torch.cat([captured[l] for l in self._taps], dim=-1) if taps else None
        return self.lm_head(h), feats

    def _norm_of(self, norm: nn.Module):
        """An RMSNorm module of the decoder as a callable of x: our kernel's one call where it runs, else the module's
        seven ops."""
        if self.rms_kernel is None:
            return norm.forward
        rms, weight, eps = self.rms_kernel.rms_norm, norm.weight, norm.variance_epsilon
        return lambda x: rms(x, weight, eps)

    def _layer_plan(self) -> tuple[list[tuple], Callable]:
        """Per decoder layer what the lean loop calls, and the final norm, bound once: looked up through nn.Module on
        every layer of every forward (a `hasattr` miss among them), they cost a few percent of a small model's forward
        (docs/performance.md#lean-layer-plan). Binding changes nothing else: the same kernels run in the same order,
        so the bits are the same. Bound at the first lean forward, when the layers are final (fused at construction, packed by `load`)."""
        if self._plan is None:
            plan = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                act = (
                    self.mlp_kernel.silu_mul
                    if self.mlp_kernel is not None
                    else _gated(mlp.act_fn, mlp.gate_proj.outputs.sizes)
                )
                qk_norm = (attn.q_norm.forward, attn.k_norm.forward) if hasattr(attn, "q_norm") else None
                plan.append(
                    (
                        self._norm_of(layer.input_layernorm),
                        attn.qkv_proj.forward,
                        attn.q_proj.outputs.sizes,
                        qk_norm,
                        attn.head_dim,
                        attn.scaling,
                        attn.o_proj.forward,
                        self._norm_of(layer.post_attention_layernorm),
                        mlp.gate_up_proj.forward,
                        act,
                        mlp.down_proj.forward,
                    )
                )
            self._plan = plan, self._norm_of(self.model.get_decoder().norm)
            self._fused = self._fused_layers()
        return self._plan

    def _fused_layers(self) -> tuple[list[tuple] | None, int]:
        """Per decoder layer the arguments of our kernel's `decoder_step` (decoder_layer.h: a step's layer in one call,
        the same calls the lean loop makes one by one) before and after the step's own, with the most tokens a step may
        have for it (more go to oneDNN's tiles, as PackedLinear sends them); None where a layer is not what it computes:
        a norm on q and k (Qwen3), a linear not on this kernel module or int8, RMSNorm or the activation not ours."""
        kernel = self.attention
        if kernel is None or self.mlp_kernel is None:
            return None, 0
        fused, tiled = [], False
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if hasattr(attn, "q_norm") or not all(
                isinstance(m, PackedLinear) and m.kernel is kernel and m.scale is None for m in linears
            ):
                return None, 0
            tiled = tiled or any(m.tiled for m in linears)
            q_size, kv_size, _ = attn.q_proj.outputs.sizes
            n1, n2, hd = layer.input_layernorm, layer.post_attention_layernorm, attn.head_dim
            fused.append(
                (
                    kv_size // hd,
                    hd,
                    (
                        n1.weight,
                        n1.variance_epsilon,
                        attn.qkv_proj.packed,
                        attn.qkv_proj.kernel_bias,
                        q_size // hd,
                        kv_size // hd,
                    ),
                    (
                        attn.scaling,
                        attn.o_proj.packed,
                        attn.o_proj.kernel_bias,
                        n2.weight,
                        n2.variance_epsilon,
                        mlp.gate_up_proj.packed,
                        mlp.gate_up_proj.kernel_bias,
                        mlp.down_proj.packed,
                        mlp.down_proj.kernel_bias,
                    ),
                )
            )
        return fused, bf16_gemm.TILE_ROWS if tiled else sys.maxsize

    def rebind(self) -> None:
        """Bind the lean loop's calls anew at the next forward: after a loaded model's packed weights or their kernel
        module were swapped (benchmarks do), which calls bound earlier would not see."""
        self._plan, self._fused = None, (None, 0)

    def _mask_rules(self) -> dict[str, int | None]:
        """Mask name -> sliding window (None = full), in the form the HF decoder takes precomputed masks."""
        types = set(getattr(self.text_config, "layer_types", None) or ["full_attention"])
        if types == {"full_attention"}:
            return {"": None}  # one 4-D mask, passed as is
        return {kind: (self.text_config.sliding_window if kind == "sliding_attention" else None) for kind in types}


class SlotKVCache(Cache):
    """Preallocated target K/V for `slots` sequences, [slots, nkv, capacity, hd] per layer (TensorRT-LLM's per-request
    slots on a static cache). Rows of a forward are contiguous slots; each row writes at its own positions, and
    its attention mask is built from those positions, so ragged rows share one forward with nothing recomputed.
    """

    def __init__(self, slots: int, capacity: int):
        super().__init__(layers=[])
        self.slots, self.capacity = slots, capacity
        self.k: list[torch.Tensor] = []  # allocated at the first write, when heads, head dim and dtype are known
        self.v: list[torch.Tensor] = []
        self._rows = slice(0, 0)
        self._positions = torch.zeros(0, 0, dtype=torch.long)
        self._same_start = True
        self._flat: FlatRows | None = None  # the layout of a forward of rows on one flat axis
        self._width = 0  # key positions the next forward's attention reads

    @property
    def first_slot(self) -> int:
        """The slot of the next forward's first row (set by `begin`)."""
        return self._rows.start

    def reserve(self, length: int) -> None:
        """Grow every slot to hold `length` positions (doubling, contents kept)."""
        if length <= self.capacity:
            return
        capacity = max(length, 2 * self.capacity)
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                new[:, :, : self.capacity] = old
                buffers[i] = new
        self.capacity = capacity

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compacting rows after one retires)."""
        for buffers in (self.k, self.v):
            for buf in buffers:
                buf[dst, :, :length] = buf[src, :, :length]

    def read(self, slot: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of slot `slot`'s positions [start, end), per layer [nkv, end - start, hd]."""
        return [k[slot, :, start:end].clone() for k in self.k], [v[slot, :, start:end].clone() for v in self.v]

    def write(self, slot: int, start: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Put what `read` returned into slot `slot` from position `start` on."""
        self.reserve(start + keys[0].shape[1])
        for layer, (key, value) in enumerate(zip(keys, values)):
            k, v = self.buffers(layer, key.shape[0], key.shape[2], key.dtype)
            k[slot, :, start : start + key.shape[1]] = key
            v[slot, :, start : start + value.shape[1]] = value

    def begin(
        self,
        first_slot: int,
        positions: torch.Tensor,
        rules: dict[str, int | None],
        dtype: torch.dtype,
        flat: FlatRows | None = None,
    ):
        """Set where the next forward writes; returns its attention mask(s) (additive, [b, 1, T, K]). With `flat`
        the forward's tokens come on one flat axis in that layout, and `positions` [b, T] is its padded per-row layout."""
        b, t = positions.shape
        self.reserve(int(positions[:, -1].max()) + 1)
        self._rows = slice(first_slot, first_slot + b)
        self._positions, self._flat = positions, flat
        self._same_start = bool(
            (positions[:, 0] == positions[0, 0]).all() and (positions[:, -1] - positions[:, 0] == t - 1).all()
        )
        kv_len = int(positions[:, -1].max()) + 1
        # Several rows of one bf16 query each (decoding, or the batched part of a FlatRows with few long rows) read
        # their slots' whole capacity under the mask while that is at most 4x the keys they need: a batched bf16 matmul
        # first copies a K/V slice that does not tile its batch (the K slice transposed), and SDPA's kernel for one
        # query costs more than the two matmuls (docs/performance.md#whole-slot-attention); with more queries per row
        # the extra keys cost what the copy saved, and fp32 reads in place.
        # One row of one query reads its slice: the lean loop attends over it in fp32 (`_lean_forward`).
        one_query = (t == 1 and b > 1) or (flat is not None and flat.long is not None)
        whole = dtype != torch.float32 and one_query and self.capacity <= 4 * kv_len
        self._width = self.capacity if whole else kv_len
        if b == 1 and t == 1 and not whole and all(w is None for w in rules.values()):
            masks = {kind: None for kind in rules}  # one query that sees its whole row
        else:
            key = torch.arange(self._width)[None, None, :]  # [1, 1, K]
            q = positions[:, :, None]  # [b, T, 1]
            masks = {}
            for kind, window in rules.items():
                visible = key <= q
                if window is not None:
                    visible = visible & (q - key < window)
                masks[kind] = visible
        out = {
            kind: None
            if m is None
            else torch.zeros(m.shape, dtype=dtype).masked_fill_(~m, torch.finfo(dtype).min)[:, None]
            for kind, m in masks.items()
        }
        return out.get("", out)

    def buffers(
        self, layer_idx: int, heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's whole K and V, [slots, heads, capacity, head_dim], allocated at its first write."""
        if layer_idx == len(self.k):
            self.k.append(torch.zeros(self.slots, heads, self.capacity, head_dim, dtype=dtype))
            self.v.append(torch.zeros(self.slots, heads, self.capacity, head_dim, dtype=dtype))
        return self.k[layer_idx], self.v[layer_idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """key/value_states [b, nkv, T, hd] -> this forward's rows' K/V [b, nkv, K, hd] (views, no copy)."""
        k, v = self.buffers(layer_idx, key_states.shape[1], key_states.shape[3], key_states.dtype)
        k, v = k[self._rows], v[self._rows]
        pos = self._positions
        if self._flat is not None:  # flat [1, nkv, T, hd]: each token into its row's slot at its position
            f = self._flat
            flat_pos = pos[f.flat_row, f.flat_col]
            k[f.flat_row, :, flat_pos] = key_states[0].transpose(0, 1)
            v[f.flat_row, :, flat_pos] = value_states[0].transpose(0, 1)
        elif self._same_start:
            s = int(pos[0, 0])
            k[:, :, s : s + pos.shape[1]] = key_states
            v[:, :, s : s + pos.shape[1]] = value_states
        else:
            rows = torch.arange(pos.shape[0])[:, None]
            k[rows, :, pos] = key_states.transpose(1, 2)
            v[rows, :, pos] = value_states.transpose(1, 2)
        return k[:, :, : self._width], v[:, :, : self._width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self._positions[:, -1].max()) + 1 if self._positions.numel() else 0
