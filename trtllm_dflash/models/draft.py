"""The DFlash block-diffusion draft: Qwen3-style layers conditioned on target features by KV injection.

Parameter names match the z-lab checkpoint (`fc`, `hidden_norm`, `layers.N.*`, `norm`); the
embedding and LM head are the target's and are passed in, never owned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.kernels.attention import block_attention
from trtllm_dflash.kernels.packed import PackedLinear, pack_linears, packs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3/Llama RMSNorm: statistics in fp32, scale in the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, hd]; cos/sin broadcastable [..., T, hd] (neox/rotate-half style, as HF Llama/Qwen)."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Inverse frequencies from transformers' RoPE init functions, so every rope_type the target uses works."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = Qwen3Config(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters),
        )
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = config.rope_theta
            inv_freq = 1.0 / (base ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scaling)
        self._table = None  # cos and sin of positions 0..n-1 [2, n, hd], fp32

    def _apply(self, fn, recurse=True):
        self._table = None  # .to() may change inv_freq's dtype or device: the table follows it
        return super()._apply(fn, recurse)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, T] -> cos, sin [b, 1, T, hd] (the 1 broadcasts over heads), looked up in a table of
        positions 0..n-1 (grown by doubling): a draft step asks for them twice, and computing them cost more than
        the lookup."""
        table = self._table
        if table is None or table.device != positions.device or table.shape[1] <= int(positions.max()):
            n = max(int(positions.max()) + 1, 2 * (0 if table is None else table.shape[1]), 256)
            freqs = torch.arange(n, device=positions.device)[:, None].float() * self.inv_freq  # [n, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            table = self._table = torch.stack([emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling])
        cos, sin = table[:, positions].to(dtype).unsqueeze(2)  # [2, b, 1, T, hd]
        return cos, sin


class DFlashAttention(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        h, nh, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(h, nh * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=config.attention_bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.num_heads, self.eps = nh, config.rms_norm_eps
        self.qkv_proj = None  # inference: q/k/v in one GEMM, and q_norm/k_norm stacked per head [nh+nkv, hd] (`fuse`)
        self.qk_norm_weight = None

    def fuse(self) -> None:
        """For inference only: one GEMM for q/k/v and one norm and RoPE pass over q and k together; the separate
        projections are dropped. The outputs are the separate ones' (every output row is the same dot product)."""
        nkv = self.k_proj.out_features // self.head_dim
        self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        self.qk_norm_weight = torch.cat(
            [
                self.q_norm.weight.detach()[None].expand(self.num_heads, -1),
                self.k_norm.weight.detach()[None].expand(nkv, -1),
            ]
        )
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x, cos, sin, norm=rms_norm):
        """x [b, Q, H] block states -> q [b, nh, Q, hd], k, v [b, nkv, Q, hd] (normed, roped). `norm`: how a fused
        projection's q and k heads are normed (the draft's kernel at inference, `DFlashDraftModel.rms`)."""
        b, q_len, _ = x.shape
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(b, q_len, -1, self.head_dim)  # [b, Q, nh+2*nkv, hd]
            nqk = self.qk_norm_weight.shape[0]
            qk = apply_rope(norm(qkv[:, :, :nqk], self.qk_norm_weight, self.eps).transpose(1, 2), cos, sin)
            return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, :, nqk:].transpose(1, 2)
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, q_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, -1, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """Training form: ctx_k/ctx_v [b, nkv, C, hd] context K/V (normed, roped); mask [b|1, 1, Q, C+Q] bool or None."""
        q, k, v = self.project(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), attn_mask=mask, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj = None  # inference: gate and up in one GEMM (`fuse`)

    def fuse(self) -> None:
        self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def fused_linear(*linears: nn.Linear) -> nn.Linear:
    """One linear computing `linears` side by side (outputs concatenated in order)."""
    bias = linears[0].bias is not None
    out = nn.Linear(
        linears[0].in_features, sum(m.out_features for m in linears), bias=bias, dtype=linears[0].weight.dtype
    )
    out.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
    if bias:
        out.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    return out


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def dflash_attention_mask(q_pos, q_anchor, q_block, k_pos, k_block, causal: bool, window: int | None):
    """Which keys each block query sees (True = attend); one rule for inference and training.

    q_pos/q_anchor/q_block [b, Q]: a query's absolute position, its block's anchor position, its block id.
    k_pos/k_block [b, K]: a key's absolute position and block id (-1 for target context).
    Context is visible strictly before the anchor (the anchor's own feature does not exist yet at
    inference); block keys only inside the query's own block, causally for SWA layers.
    Returns [b, 1, Q, K].
    """
    qp, qa, qb = q_pos[:, :, None], q_anchor[:, :, None], q_block[:, :, None]
    kp, kb = k_pos[:, None, :], k_block[:, None, :]
    ctx = (kb < 0) & (kp < qa)
    own = kb == qb
    if causal:
        own = own & (kp <= qp)
    visible = ctx | own
    if window is not None:
        visible = visible & (qp - kp < window)
    return visible[:, None]


class DraftKVCache:
    """Context K/V of every draft layer for `slots` requests, preallocated. The target features that have yet to
    become context K/V are each request's own (request.PendingFeatures), so moving a row moves its K/V alone.

    k/v [L, slots, nkv, capacity, hd]: slot i's positions [0, lengths[i]) are valid.
    """

    def __init__(self, config: DraftConfig, slots: int, capacity: int, dtype, device=None):
        shape = (config.num_hidden_layers, slots, config.num_key_value_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots

    def reserve(self, length: int) -> None:
        capacity = self.k.shape[3]
        if length > capacity:
            grow = max(length, 2 * capacity) - capacity
            self.k = torch.cat([self.k, self.k.new_zeros(*self.k.shape[:3], grow, self.k.shape[4])], dim=3)
            self.v = torch.cat([self.v, self.v.new_zeros(*self.v.shape[:3], grow, self.v.shape[4])], dim=3)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [L, 1, nkv, N, hd] of N context tokens, token n going to (slots[n], positions[n])."""
        self.reserve(int(positions.max()) + 1)
        self.k[:, slots, :, positions] = k[:, 0].permute(2, 0, 1, 3)  # advanced indices first: [N, L, nkv, hd]
        self.v[:, slots, :, positions] = v[:, 0].permute(2, 0, 1, 3)

    def move(self, src: int, dst: int) -> None:
        """Slot src's context K/V into slot dst."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        n_sel, h = len(config.target_layer_ids), config.hidden_size
        self.fc = nn.Linear(n_sel * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        dflash = config.extra.get("dflash_config", {})
        self.input_embedding_scale = float(dflash.get("input_embedding_scale", 1.0))  # Gemma-style targets
        self.output_multiplier = float(dflash.get("output_multiplier", 1.0))
        self.final_logit_softcapping = float(dflash.get("final_logit_softcapping") or 0.0)
        self._stacked = None  # stacked context K/V projection of all layers: (linear callable, k_norm weights [L, hd])
        self._vocab = (
            None  # inference-time draft vocabulary (models/draft_vocab.py): (token ids [N], head over their rows)
        )
        self.ngram = None  # inference-time n-gram prior on greedy guesses (models/draft_ngram.py)
        self.packed = False
        self.int8 = False  # packed with int8 weights (`pack`, where our kernel takes them)
        self._kernel = (
            None  # our bf16 kernel module for RMSNorm and the MLP's activation at inference (`pack`), or None:
        )
        # the torch ops

    def pack(self, int8: bool = False) -> None:
        """For inference only (no training or export after it): the context K/V projection of all layers stacked into
        one linear, each layer's q/k/v and gate/up fused into one GEMM each, then every linear prepacked for oneDNN
        (kernels/packed.py); `int8`: as int8 weights where our kernel takes them (PackedLinear), the vocabulary's head too."""
        attns = [layer.self_attn for layer in self.layers]
        self.ctx_kv_proj = fused_linear(*(p for a in attns for p in (a.k_proj, a.v_proj)))
        k_norm = torch.stack([a.k_norm.weight.detach() for a in attns])
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.int8 = int8 and self.fc.weight.dtype == torch.bfloat16 and bf16_gemm.int8_weights()
        pack_linears(self, int8=self.int8)
        self._stacked = (self.ctx_kv_proj, k_norm)
        self.packed = True
        c = self.config
        if (
            k_norm.dtype == torch.bfloat16
            and c.hidden_size % 16 == 0
            and c.head_dim % 16 == 0
            and c.intermediate_size % 16 == 0
        ):
            self._kernel = bf16_gemm.kernel()

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=std, generator=generator)
        self._stacked = None

    def train(self, mode: bool = True):
        if self.packed:
            if mode:
                raise DFlashError("A packed draft is for inference only; load it again to train it.")
            return super().train(False)
        self._stacked = None  # weights may change; rebuild the stacked projection when back in eval
        return super().train(mode)

    def _context_projection(self):
        """The k/v projections of all layers stacked: (callable ctx [b, T, H] -> [b, T, L*2*nkv*hd], k_norm weights
        [L, hd]), built once outside training."""
        if self._stacked is not None and not self.training:
            return self._stacked
        attns = [layer.self_attn for layer in self.layers]
        weight = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])
        bias = (
            torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)])
            if self.config.attention_bias
            else None
        )
        stacked = (lambda x: F.linear(x, weight, bias)), torch.stack([a.k_norm.weight for a in attns])
        if not self.training:
            self._stacked = stacked
        return stacked

    def rms(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm at inference: one call of our kernel in a packed bf16 draft where it runs (weight [H], or [G, H]
        for x [..., G, H]), else the eight torch ops of `rms_norm`."""
        return self._kernel.rms_norm(x, weight, eps) if self._kernel is not None else rms_norm(x, weight, eps)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[b, T, n_sel*H] concatenated target features -> fused context feature [b, T, H]."""
        return self.rms(self.fc(target_hidden), self.hidden_norm.weight, self.config.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context K/V of all layers in one GEMM (no draft prefill): ctx [b, T, H] -> k, v [L, b, nkv, T, hd]."""
        c = self.config
        b, t, _ = ctx.shape
        L, nkv = c.num_hidden_layers, c.num_key_value_heads
        project, k_norm = self._context_projection()
        kv = project(ctx).view(b, t, L, 2, nkv, c.head_dim)
        if self._kernel is not None:  # every layer's K heads in one call, each with its layer's norm
            k = self._kernel.rms_norm(
                kv[:, :, :, 0].reshape(b, t, L * nkv, c.head_dim),
                k_norm[:, None].expand(L, nkv, c.head_dim).reshape(L * nkv, c.head_dim),
                c.rms_norm_eps,
            )
            k = k.view(b, t, L, nkv, c.head_dim).permute(2, 0, 3, 1, 4)  # [L, b, nkv, T, hd]
            cos, sin = self.rotary_emb(positions, ctx.dtype)
            return apply_rope(k, cos, sin), kv.permute(2, 3, 0, 4, 1, 5)[:, 1]
        kv = kv.permute(2, 3, 0, 4, 1, 5)  # [L, 2, b, nkv, T, hd]
        k = rms_norm(kv[:, 0], k_norm[:, None, None, None, :], c.rms_norm_eps)
        cos, sin = self.rotary_emb(positions, ctx.dtype)  # [b, 1, T, hd]
        return apply_rope(k, cos, sin), kv[:, 1]

    def draft_block(self, noise_embedding, positions, ctx_k, ctx_v, ctx_lens):
        """Inference: one block per row over ragged context caches, through the block-attention op.

        noise_embedding [b, Q, H]; positions [b, Q] (row i's block starts at ctx_lens[i]);
        ctx_k/ctx_v [L, b, nkv, C, hd], row i valid below ctx_lens[i] [b]. Returns final-normed hidden [b, Q, H].
        """
        c, x = self.config, noise_embedding
        b, q_len, _ = x.shape
        cos, sin = self.rotary_emb(positions, x.dtype)
        eps = c.rms_norm_eps
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = attn.project(self.rms(x, layer.input_layernorm.weight, eps), cos, sin, norm=self.rms)
            out = block_attention(q, k, v, ctx_k[i], ctx_v[i], ctx_lens, c.layer_is_causal(i), c.layer_window(i))
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
            h = self.rms(x, layer.post_attention_layernorm.weight, eps)
            if self._kernel is not None:  # silu(gate) * up in one call (activation.h)
                x = x + layer.mlp.down_proj(self._kernel.silu_mul(layer.mlp.gate_up_proj(h)))
            else:
                x = x + layer.mlp(h)
        return self.rms(x, self.norm.weight, eps)

    def embed_block(self, embed_tokens: nn.Module, block_ids: torch.Tensor) -> torch.Tensor:
        """[anchor, MASK, ...] ids -> noise embedding: raw rows of the target's (frozen) table, times the
        draft's own input_embedding_scale (z-lab semantics; a scaled embedding module's scale is not applied)."""
        x = F.embedding(block_ids, embed_tokens.weight)
        return x * self.input_embedding_scale if self.input_embedding_scale != 1.0 else x

    def use_vocab(self, token_ids: torch.Tensor | None, lm_head: nn.Module) -> None:
        """For inference only: guess among `token_ids` alone (a draft vocabulary, models/draft_vocab.py), through a
        head over just their rows of the target's LM head; None guesses over the whole vocabulary again."""
        if token_ids is None:
            self._vocab = None
            return
        head = nn.Linear(lm_head.in_features, len(token_ids), bias=lm_head.bias is not None, dtype=lm_head.weight.dtype)
        head.weight = nn.Parameter(lm_head.weight.detach()[token_ids].clone(), requires_grad=False)
        if lm_head.bias is not None:
            head.bias = nn.Parameter(lm_head.bias.detach()[token_ids].clone(), requires_grad=False)
        self._vocab = (
            token_ids,
            PackedLinear(head, int8=self.int8) if packs(head.weight) else head,
            lm_head.out_features,
        )

    @property
    def vocab_token_ids(self) -> torch.Tensor | None:
        """The draft vocabulary in use (`use_vocab`), or None for the whole vocabulary."""
        return None if self._vocab is None else self._vocab[0]

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module, full: bool = True) -> torch.Tensor:
        """Draft logits through the target's LM head, with the config's multiplier and soft-capping. With a draft
        vocabulary, tokens outside it get -inf (probability 0, never the argmax); `full=False` keeps only the
        vocabulary's columns, in `vocab_token_ids` order: all a greedy guess needs (`to_full_vocab` restores the rest)."""
        logits = lm_head(hidden) if self._vocab is None else self._vocab[1](hidden)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping > 0:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return self.to_full_vocab(logits) if full else logits

    def to_full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary's columns [..., N] -> over the whole vocabulary, -inf outside it."""
        if self._vocab is None:
            return logits
        ids, _, vocab = self._vocab
        full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
        full[..., ids] = logits
        return full

    def forward(self, noise_embedding, positions, ctx_k, ctx_v, masks=None):
        """Run the block queries.

        noise_embedding [b, Q, H]: target embeddings of [anchor, MASK, ...] per block.
        positions [b, Q]: absolute positions of the queries. ctx_k/ctx_v [L, b, nkv, C, hd].
        masks: per-layer [b|1, 1, Q, C+Q] bool masks, or None for "every query sees every key".
        Returns final-normed hidden states [b, Q, H] for the target's LM head.
        """
        x = noise_embedding
        cos, sin = self.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_k[i], ctx_v[i], None if masks is None else masks[i])
        return self.norm(x)
