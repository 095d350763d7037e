"""Block-diffusion training of a DFlash draft against a frozen target (method notes, section 4.2).

Per sequence: random anchors inside the response, blocks [token at anchor, MASK x (B-1)], all blocks
in one draft forward under the inference mask rule (context strictly before the anchor, own block
only), same-position labels for slots 1..B-1, CE through the frozen LM head weighted exp(-(k-1)/gamma), or
(`loss="dpace"`) by D-PACE's dynamic weights (method notes, section 4.2 variants). With `kd`, each slot's label
mixes in the target's own distribution there (knowledge distillation, as Model Optimizer trains its drafts).
Target features come from the data phase (captured while the target generated the responses).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trtllm_dflash.config import DRAFT_LOSSES, DraftConfig
from trtllm_dflash.cpu import machine_info, resolve_dtype, trains_in_bf16
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import CARD_FILE, load_draft, read_draft_config, save_draft
from trtllm_dflash.models.draft import DFlashDraftModel, dflash_attention_mask
from trtllm_dflash.train.records import read_dataset, read_features

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # paper / ModelOpt loss decay per block size
DPACE_ALPHA = 0.5  # D-PACE's smoothing of the draft's confidence (arXiv 2605.18810; SpecForge PR #578)
STATE_FILE = "state.pt"
DRAFT_SUBDIR = "draft"
RUN_FILES = {"data.json", "data.jsonl", "data.features.bin", STATE_FILE, DRAFT_SUBDIR, "train_log.jsonl"}


@dataclass
class TrainArgs:
    num_layers: int = 3
    block_size: int = 8
    mask_token_id: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    steps: int | None = None
    epochs: float = 1.0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: GAMMA[block_size], else block_size / 2
    loss: str = "decay"  # slot weights: fixed exp(-(k-1)/gamma), or "dpace" (dynamic, from the draft's own confidence)
    kd: float = 0.0  # share of the target's distribution in each slot's label (0: its greedy token alone)
    max_seq_len: int = 1024
    anchors_per_seq: int = 64
    seqs_per_step: int = 4
    logits_chunk: int = 256
    train_vocab_negatives: int | None = 4096  # None: softmax over the full vocabulary in training steps
    val_fraction: float = 0.02
    eval_every: int = 100
    checkpoint_minutes: float = 5.0
    bf16: bool = True
    seed: int = 0
    init_from: str | None = None  # a draft of the same architecture to start from (warm start on new data)
    short_blocks: float = 0.0  # share of training blocks cut to a random width 2..block_size-1 (see _sequence)

    @property
    def loss_gamma(self) -> float:
        return self.gamma or GAMMA.get(self.block_size, self.block_size / 2)


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] per-slot weights: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1 (first prediction weighs 1)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(q: torch.Tensor, valid: torch.Tensor, block_size: int, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE slot weights [N*B] from q [N*B], the draft's probability of each slot's label (detached).

    Slot j weighs w_j = sum_{m>=j} prod_{i<=m} q~_i with q~ = (1-alpha) q + alpha: the acceptance length a slot can
    still add, so a slot after one the draft is unsure of counts for less (a fixed decay weighs it the same in every
    block). The anchor slot and invalid slots weigh 0, and an invalid slot ends its block's chain."""
    on = valid.view(-1, block_size).to(q.dtype)
    qt = ((1 - alpha) * q + alpha).view(-1, block_size) * on
    qt[:, 0] = 1.0
    reach = qt.cumprod(1)  # [N, B]: prod_{i<=m} q~_i
    w = reach.flip(1).cumsum(1).flip(1) * on
    w[:, 0] = 0.0
    return w.flatten()


def held_out(key: str, fraction: float) -> bool:
    """Whether the record `key` is in the validation share: by a hash of the key, so a record stays on its side as the
    data grows (and bench_acceptance can pose the held-out chat questions)."""
    return zlib.crc32(key.encode()) % 1000 < fraction * 1000


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions i where token i and token i+1 are both response tokens: a block there has something to predict."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Up to n distinct valid anchors, uniformly at random, sorted."""
    valid = valid_anchors(loss_mask)
    pick = torch.randperm(len(valid), generator=generator)[:n]
    return valid[pick].sort().values


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_id: int,
    widths: torch.Tensor | None = None,
):
    """Noise ids, positions, labels and label validity of N blocks, flattened to [N*B].

    Slot k of the block at anchor a sits at position a+k and is labelled with the token AT a+k
    (same position, no shift); it counts only if a+k is a response token inside the sequence, and if k is below
    its block's width (`widths` [N]: a block drafted over its first w slots only; None: all B).
    """
    s = input_ids.shape[0]
    offs = torch.arange(block_size)
    pos = anchors[:, None] + offs  # [N, B]
    inside = pos < s
    clamped = pos.clamp(max=s - 1)
    noise = torch.full_like(pos, mask_id)
    noise[:, 0] = input_ids[anchors]
    labels = input_ids[clamped]
    valid = inside & loss_mask.bool()[clamped] & (offs > 0)
    if widths is not None:
        valid &= offs < widths[:, None]
    return noise.flatten(), pos.flatten(), labels.flatten(), valid.flatten()


def training_mask(
    anchors: torch.Tensor,
    seq_len: int,
    block_size: int,
    causal: bool = False,
    window: int | None = None,
    widths: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, 1, N*B, S + N*B] mask over keys [S context | N*B block slots]; the inference rule, via dflash_attention_mask.
    `widths` [N]: block n has only its first widths[n] slots (the rest are no keys to anyone)."""
    n = anchors.shape[0]
    q_pos = (anchors[:, None] + torch.arange(block_size)).flatten()
    q_block = torch.arange(n).repeat_interleave(block_size)
    q_anchor = anchors.repeat_interleave(block_size)
    k_pos = torch.cat([torch.arange(seq_len), q_pos])
    k_block = torch.cat([torch.full((seq_len,), -1), q_block])
    mask = dflash_attention_mask(q_pos[None], q_anchor[None], q_block[None], k_pos[None], k_block[None], causal, window)
    if widths is not None:
        present = torch.cat(
            [torch.ones(seq_len, dtype=torch.bool), (torch.arange(block_size) < widths[:, None]).flatten()]
        )
        mask = mask & present
    return mask


def block_hidden(
    draft: DFlashDraftModel,
    embed_tokens,
    feats: torch.Tensor,
    noise: torch.Tensor,
    positions: torch.Tensor,
    anchors: torch.Tensor,
    widths: torch.Tensor | None = None,
) -> torch.Tensor:
    """feats [S, n_sel*H], blocks flattened [N*B] -> draft hidden states [N*B, H] (one sequence, all blocks at once)."""
    c = draft.config
    s = feats.shape[0]
    ctx = draft.project_context(feats[None])
    k, v = draft.context_kv(ctx, torch.arange(s)[None])
    masks = [
        training_mask(anchors, s, c.block_size, c.layer_is_causal(i), c.layer_window(i), widths)
        for i in range(c.num_hidden_layers)
    ]
    x = draft.embed_block(embed_tokens, noise[None]).to(ctx.dtype)  # the target's table may be bf16 in an fp32 run
    return draft(x, positions[None], k, v, masks)[0]


class _ChunkedLMHeadCE(torch.autograd.Function):
    """Weighted CE through the frozen LM head, chunk by chunk: each chunk's logits are made, turned into the
    loss and the input gradient (softmax - label, by hand: fewer passes over [chunk, V] than autograd), and
    dropped, so N*B*V logits never exist at once and nothing is recomputed in backward. With `dpace_block`,
    each chunk's weights become D-PACE's (scaled to the chunk's given total; a chunk holds whole blocks).
    With `soft` = (probs [U, V], rows [M], kd), slot m's label is (1 - kd) onehot + kd probs[rows[m]].
    """

    @staticmethod
    def forward(ctx, hidden, labels, weights, draft, lm_head, chunk, need_grad, dpace_block, soft):
        total = hidden.new_zeros((), dtype=torch.float32)
        grads, correct = [], []
        rows, kd = (soft[1].split(chunk), soft[2]) if soft else (itertools.repeat(None), 0.0)
        for h, y, w, r in zip(hidden.split(chunk), labels.split(chunk), weights.split(chunk), rows):
            with torch.set_grad_enabled(need_grad):
                h = h.detach().requires_grad_(need_grad)
                logits = draft.compute_logits(h, lm_head)  # [chunk, V]
            with torch.no_grad():
                z = logits.detach()
                correct.append(z.argmax(-1) == y)
                p = torch.softmax(z, -1, dtype=torch.float32)  # one fused pass over [chunk, V], fp32 out
                q = p.gather(1, y[:, None])[:, 0]
                if dpace_block:
                    dyn = dpace_weights(q, w > 0, dpace_block)
                    w = dyn * (w.sum() / dyn.sum().clamp_min(1e-12))
                ce = -q.clamp_min(1e-30).log()
                if soft:
                    pt = soft[0][r]  # the target's distribution at each slot [chunk, V]
                    ce = (1 - kd) * ce + kd * (torch.logsumexp(z.float(), -1) - (pt * z).sum(-1))
                total += (ce * w).sum()
                if need_grad:
                    if soft:
                        p.sub_(pt, alpha=kd)
                    p[torch.arange(len(y)), y] -= 1 - kd
                    g = p.mul_(w[:, None]).to(logits.dtype)
            if need_grad:
                grads.append(torch.autograd.grad(logits, h, g)[0])
        ctx.save_for_backward(torch.cat(grads) if need_grad else hidden.new_zeros(0))
        correct = torch.cat(correct)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (g,) = ctx.saved_tensors
        return g * grad_total, None, None, None, None, None, None, None, None


def frozen_head(weight: torch.Tensor, dtype: torch.dtype) -> torch.nn.Linear:
    """A frozen LM head already in the autocast dtype: autocast would recast a frozen weight at every chunk."""
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype).requires_grad_(False)
    head.weight.data = weight.to(dtype)
    return head


def sampled_lm_head(lm_head, data_vocab: torch.Tensor, negatives: int, generator: torch.Generator):
    """A frozen head over the tokens the data uses plus `negatives` random others, and the full-id -> row map.

    The LM head is ~2/3 of a CPU training step; the target's own answers use a few thousand of its ids,
    so training the softmax over those (plus fresh random negatives each step, which keep the rest of the
    vocabulary pushed down) makes steps several times cheaper. Evaluation always uses the full head.
    """
    v = lm_head.weight.shape[0]
    outside = torch.ones(v, dtype=torch.bool)
    outside[data_vocab] = False
    others = torch.nonzero(outside).flatten()
    ids = torch.cat([data_vocab, others[torch.randperm(len(others), generator=generator)[:negatives]]])
    head = frozen_head(lm_head.weight.data[ids], lm_head.weight.dtype)
    row = torch.full((v,), -1, dtype=torch.long)
    row[ids] = torch.arange(len(ids))
    return head, row


def chunked_lm_head_ce(draft, lm_head, hidden, labels, weights, chunk: int, dpace_block: int | None = None, soft=None):
    """hidden [M, H], labels/weights [M] -> (sum_m weights*CE, correct [M] bool); `dpace_block`: D-PACE weights
    instead of `weights` (whose per-chunk totals they keep), over blocks of that size; `soft`: (probs [U, V] over
    lm_head's rows, rows [M] into probs, kd) mixes the target's distribution into the labels."""
    if dpace_block and chunk % dpace_block:
        raise ValueError(
            f"D-PACE needs whole blocks per chunk: chunk {chunk} is not a multiple of block size {dpace_block}"
        )
    return _ChunkedLMHeadCE.apply(
        hidden, labels, weights, draft, lm_head, chunk, hidden.requires_grad, dpace_block, soft
    )


def target_distribution(final_norm, head, last_hidden: torch.Tensor, positions: torch.Tensor):
    """The target's next-token distribution for each slot: (probs [U, V] over head's rows, rows [M] into them).

    Slot m sits at positions[m] and is labelled with the token there, which the target predicted from its last
    layer at positions[m] - 1; last_hidden [S, H] is that layer's output (before the final norm) for the sequence.
    Blocks overlap, so each position's distribution is made once (U <= S).
    """
    at, rows = torch.unique((positions - 1).clamp(0, last_hidden.shape[0] - 1), return_inverse=True)
    with torch.no_grad():
        return torch.softmax(head(final_norm(last_hidden[at])).float(), -1), rows


def acceptance_stats(correct: torch.Tensor, valid: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block leading run of correct slots 1..B-1 (a greedy verifier accepts exactly that prefix).

    correct/valid [N*B] -> accepted [N] (simulated tau of a block = 1 + accepted), and ok [N, B-1].
    """
    ok = (correct & valid).view(-1, block_size)[:, 1:]
    return ok.long().cumprod(dim=1).sum(dim=1), ok


class DraftTrainer:
    """Owns draft, optimiser, schedule, data order and checkpoints of one run in `out_dir`."""

    def __init__(self, target, out_dir: Path, args: TrainArgs):
        self.target, self.out_dir, self.args = target, out_dir, args
        self.records = [self._clip(r) for r in read_dataset(out_dir / "data.jsonl")]
        meta = json.loads((out_dir / "data.json").read_text())
        self.feat_layer_ids = meta["target_layer_ids"]
        self.features = read_features(out_dir / "data.jsonl", len(self.feat_layer_ids) * target.hidden_size)
        cols = [self.feat_layer_ids.index(l) for l in args.target_layer_ids if l in self.feat_layer_ids]
        if len(cols) != len(args.target_layer_ids):
            raise DFlashError(
                f"The data holds features of target layers {self.feat_layer_ids}, not all of {args.target_layer_ids}."
            )
        h = target.hidden_size
        whole = cols == list(range(len(self.feat_layer_ids)))  # the usual case: a slice, not a gather
        self.feat_cols = slice(None) if whole else torch.cat([torch.arange(c * h, (c + 1) * h) for c in cols])
        self.last_cols = None
        if args.kd:
            last = target.num_layers - 1
            if last not in self.feat_layer_ids:
                raise DFlashError(
                    f"--kd needs the target's last layer ({last}) in the data's features, which hold layers "
                    f"{self.feat_layer_ids}; start the run in a new --output."
                )
            c = self.feat_layer_ids.index(last)
            self.last_cols, self.final_norm = slice(c * h, (c + 1) * h), target.model.get_decoder().norm
        is_val = [held_out(r["key"], args.val_fraction) for r in self.records]
        self.val = [r for r, v in zip(self.records, is_val) if v]
        self.train = [
            r for r, v in zip(self.records, is_val) if not v and len(valid_anchors(torch.tensor(r["loss_mask"])))
        ]
        if not self.train:
            raise DFlashError("No training sequence has a response of at least 2 tokens; generate more data.")
        steps_per_epoch = max(1, len(self.train) // args.seqs_per_step)
        self.total_steps = args.steps or max(1, math.ceil(args.epochs * steps_per_epoch))
        config = DraftConfig.for_target(
            target.text_config,
            vocab_rows=target.vocab_rows,
            num_layers=args.num_layers,
            block_size=args.block_size,
            mask_token_id=args.mask_token_id,
            target_layer_ids=args.target_layer_ids,
        )
        if args.short_blocks:  # the runtime then drafts a block of k tokens over k + 1 slots (DraftConfig.short_blocks)
            config.extra.setdefault("dflash_config", {})["short_blocks"] = args.short_blocks
        torch.manual_seed(args.seed)
        self.draft = DFlashDraftModel(config)
        self.draft.init_weights(generator=torch.Generator().manual_seed(args.seed))
        self.init_card = self._warm_start(Path(args.init_from)) if args.init_from else None
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
        )
        warmup = max(1, int(args.warmup_ratio * self.total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: (
                min(1.0, (s + 1) / warmup)
                * 0.5
                * (1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, self.total_steps - warmup))))
            ),
        )
        self.weights = loss_weights(args.block_size, args.loss_gamma)
        self.full_head = frozen_head(target.lm_head.weight.data, torch.bfloat16 if args.bf16 else torch.float32)
        self.data_vocab = torch.unique(torch.cat([torch.tensor(r["input_ids"]) for r in self.train]))
        self.generator = torch.Generator().manual_seed(args.seed + 1)
        self.step, self.epoch, self.cursor, self.train_seconds = 0, 0, 0, 0.0
        self.last_eval: dict = {}

    def _warm_start(self, path: Path) -> dict:
        """Load an earlier draft's weights; returns its training card (or {}) for the new card's provenance.

        A start with fewer layers grows: its layers are copied and each new one starts as the identity (attention and
        MLP output projections zero), so the grown draft begins exactly where the start draft stands.
        """
        start = load_draft(path)
        a, b = start.config, self.draft.config
        keys = ("block_size", "hidden_size", "target_layer_ids", "mask_token_id", "vocab_size")
        diff = [k for k in keys if getattr(a, k) != getattr(b, k)]
        if diff:
            raise DFlashError(
                f"--init-from {path} has a different {diff[0]} ({getattr(a, diff[0])} vs {getattr(b, diff[0])}); "
                "match --block-size/--mask-token-id to it."
            )
        if a.num_hidden_layers > b.num_hidden_layers:
            raise DFlashError(
                f"--init-from {path} has {a.num_hidden_layers} layers, more than --num-layers {b.num_hidden_layers}; "
                "a draft can grow, not shrink."
            )
        missing, unexpected = self.draft.load_state_dict(start.state_dict(), strict=False)
        new = tuple(f"layers.{i}." for i in range(a.num_hidden_layers, b.num_hidden_layers))
        assert not unexpected and all(k.startswith(new) for k in missing), (missing, unexpected)
        with torch.no_grad():
            for layer in self.draft.layers[a.num_hidden_layers :]:
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
        card = path / CARD_FILE
        return json.loads(card.read_text()) if card.is_file() else {}

    def _clip(self, r: dict) -> dict:
        n = self.args.max_seq_len
        return {**r, "input_ids": r["input_ids"][:n], "loss_mask": r["loss_mask"][:n]}

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(self.args.seed * 1000 + epoch).shuffle(order)
        return order

    def _next_records(self) -> list[dict]:
        out = []
        while len(out) < self.args.seqs_per_step:
            order = self._order(self.epoch)
            if self.cursor >= len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
                continue
            out.append(self.train[order[self.cursor]])
            self.cursor += 1
        return out

    def _sequence(self, r: dict, anchors_n: int, generator: torch.Generator, short: float = 0.0):
        """One sequence's blocks; a `short` share of them cut to a random width below the block size, so that the
        draft also guesses well from a block of only the slots a short verify needs (3 instead of 8 for a 2-token
        block): a draft trained on whole blocks alone guesses far worse from fewer mask slots, as its in-block
        attention is bidirectional (TRAINING.md, "Short blocks")."""
        ids, lm = torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"])
        anchors = sample_anchors(lm, anchors_n, generator)
        b, widths = self.args.block_size, None
        if short:
            n = len(anchors)
            cut = torch.rand(n, generator=generator) < short
            widths = torch.where(cut, torch.randint(2, b, (n,), generator=generator), torch.full((n,), b))
        noise, pos, labels, valid = build_blocks(ids, lm, anchors, b, self.args.mask_token_id, widths)
        rows = self.features[r["feat_offset"] : r["feat_offset"] + len(ids)]
        if not self.args.bf16:  # stored in bf16; an fp32 run computes in fp32
            rows = rows.float()
        last = rows[:, self.last_cols] if self.last_cols is not None else None
        w = self.weights.repeat(len(anchors)) * valid
        return rows[:, self.feat_cols], last, anchors, widths, noise, pos, labels, valid, w

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.args.bf16)

    def train_step(self) -> dict:
        """One optimiser step over seqs_per_step sequences; loss is the weighted mean over all their slots."""
        self.draft.train()
        seqs = [
            self._sequence(r, self.args.anchors_per_seq, self.generator, self.args.short_blocks)
            for r in self._next_records()
        ]
        total_w = sum(s[-1].sum() for s in seqs).clamp(min=1e-6)
        if self.args.train_vocab_negatives is None:
            head, row = self.full_head, None
        else:
            head, row = sampled_lm_head(
                self.full_head, self.data_vocab, self.args.train_vocab_negatives, self.generator
            )
        loss_sum, accepted = 0.0, []
        for feats, last, anchors, widths, noise, pos, labels, valid, w in seqs:
            with self._autocast():
                hidden = block_hidden(self.draft, self.target.embed_tokens, feats, noise, pos, anchors, widths)
                labels = labels if row is None else row[labels]
                soft = (
                    (*target_distribution(self.final_norm, head, last, pos), self.args.kd) if last is not None else None
                )
                loss, correct = chunked_lm_head_ce(
                    self.draft,
                    head,
                    hidden,
                    labels,
                    w / total_w,
                    self.args.logits_chunk,
                    self.args.block_size if self.args.loss == "dpace" else None,
                    soft,
                )
            loss.backward()
            loss_sum += loss.item()
            accepted.append(acceptance_stats(correct, valid, self.args.block_size)[0])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return {
            "loss": loss_sum,
            "tau": 1 + torch.cat(accepted).float().mean().item(),
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss, per-slot accuracy and simulated tau with fixed anchors (comparable across steps)."""
        self.draft.eval()
        gen = torch.Generator().manual_seed(12345)
        loss_sum, w_sum, accepted, oks, valids = 0.0, 0.0, [], [], []
        for r in self.val:
            if not len(valid_anchors(torch.tensor(r["loss_mask"]))):
                continue
            feats, _, anchors, _, noise, pos, labels, valid, w = self._sequence(r, self.args.anchors_per_seq, gen)
            with self._autocast():
                hidden = block_hidden(self.draft, self.target.embed_tokens, feats, noise, pos, anchors)
                loss, correct = chunked_lm_head_ce(
                    self.draft, self.full_head, hidden, labels, w, self.args.logits_chunk
                )
            loss_sum, w_sum = loss_sum + loss.item(), w_sum + w.sum().item()
            acc, ok = acceptance_stats(correct, valid, self.args.block_size)
            accepted.append(acc)
            oks.append(ok)
            valids.append(valid.view(-1, self.args.block_size)[:, 1:])
        if not accepted:
            return {}
        ok, valid = torch.cat(oks).float(), torch.cat(valids).float()
        per_pos = (ok.sum(0) / valid.sum(0).clamp(min=1)).tolist()
        self.last_eval = {
            "step": self.step,
            "val_loss": loss_sum / max(w_sum, 1e-6),
            "val_tau": 1 + torch.cat(accepted).float().mean().item(),
            "val_acc_per_position": [round(a, 4) for a in per_pos],
            "val_blocks": int(ok.shape[0]),
        }
        return self.last_eval

    def state_dict(self) -> dict:
        return {
            "args": asdict(self.args),
            "draft": self.draft.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": self.step,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "total_steps": self.total_steps,
            "train_seconds": self.train_seconds,
            "last_eval": self.last_eval,
        }

    def load_state_dict(self, state: dict) -> None:
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.epoch, self.cursor = state["step"], state["epoch"], state["cursor"]
        self.total_steps, self.train_seconds, self.last_eval = (
            state["total_steps"],
            state["train_seconds"],
            state["last_eval"],
        )

    def checkpoint(self, card: dict | None = None) -> None:
        """Training state (atomic rename) and a loadable bf16 draft, so a kill at any time leaves a valid draft."""
        tmp = self.out_dir / f".{STATE_FILE}.tmp"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, self.out_dir / STATE_FILE)
        extra = {CARD_FILE: json.dumps(card, indent=2) + "\n"} if card else None
        save_draft(self.draft, self.out_dir / DRAFT_SUBDIR, dtype=torch.bfloat16, extra_files=extra)


def check_output_dir(out_dir: Path, resume: bool) -> None:
    """Refuse a directory holding anything but our own run files, and an existing run without --resume."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DFlashError(f"--output {out_dir} is a file; pass a directory.")
    if not out_dir.exists():
        return
    names = {p.name for p in out_dir.iterdir() if not p.name.startswith(".")}
    foreign = sorted(names - RUN_FILES)
    if foreign:
        raise DFlashError(
            f"--output {out_dir} already holds other files ({', '.join(foreign[:3])}); pass an empty or new directory."
        )
    if names and not resume:
        raise DFlashError(
            f"--output {out_dir} holds an earlier training run; pass --resume to continue it or choose a new directory."
        )


def run_training(
    target,
    out_dir: Path,
    args: TrainArgs,
    data_meta: dict,
    resume: bool,
    progress_bar: bool = True,
    command: str | None = None,
    target_name: str | None = None,
) -> dict:
    """Train (or continue) a draft from out_dir's data; returns the training card, also written as draft/training.json."""
    from tqdm import tqdm

    state_path = out_dir / STATE_FILE
    state = torch.load(state_path, weights_only=False) if resume and state_path.is_file() else None
    if state is not None:
        saved = TrainArgs(**state["args"])
        if (saved.num_layers, saved.block_size, saved.target_layer_ids) != (
            args.num_layers,
            args.block_size,
            args.target_layer_ids,
        ):
            raise DFlashError(
                f"{out_dir} holds a run with {saved.num_layers} layers and block size {saved.block_size}; "
                "resume it with the same --num-layers/--block-size or choose a new --output."
            )
        args = saved  # the run continues with the hyper-parameters it started with
    trainer = DraftTrainer(target, out_dir, args)
    if state is not None:
        trainer.load_state_dict(state)
    log = open(out_dir / "train_log.jsonl", "a")
    started = time.time()

    def card() -> dict:
        return {
            "target": target_name or str(target.path),
            "command": command,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info(),
            "data": {
                k: data_meta.get(k)
                for k in (
                    "sources",
                    "records",
                    "response_tokens",
                    "seconds",
                    "max_new_tokens",
                    "dtype",
                    "code_packages",
                    "magpie",
                )
            },
            "train_records": len(trainer.train),
            "val_records": len(trainer.val),
            "features": "captured from the target during data generation (bf16), cached on disk",
            "steps": trainer.step,
            "total_steps": trainer.total_steps,
            "epochs_seen": round(trainer.step * args.seqs_per_step / len(trainer.train), 3),
            "hyperparameters": {**asdict(args), "gamma": args.loss_gamma},
            "train_seconds": round(trainer.train_seconds, 1),
            "final_metrics": trainer.last_eval,
            **(
                {
                    "initialized_from": {
                        "path": args.init_from,
                        **{k: trainer.init_card.get(k) for k in ("command", "date", "steps", "train_seconds", "data")},
                    }
                }
                if args.init_from
                else {}
            ),
        }

    bar = tqdm(
        total=trainer.total_steps, initial=trainer.step, disable=not progress_bar, dynamic_ncols=True, mininterval=5
    )
    last_ckpt, tau_ema = time.time(), None
    while trainer.step < trainer.total_steps:
        t0 = time.time()
        m = trainer.train_step()
        trainer.train_seconds += time.time() - t0
        tau_ema = m["tau"] if tau_ema is None else 0.95 * tau_ema + 0.05 * m["tau"]
        row = {"step": trainer.step, **{k: round(v, 5) for k, v in m.items()}}
        if trainer.step % args.eval_every == 0 or trainer.step == trainer.total_steps:
            row.update(trainer.evaluate())
        log.write(json.dumps(row) + "\n")
        log.flush()
        bar.set_postfix(
            loss=f"{m['loss']:.3f}",
            tau=f"{tau_ema:.2f}",
            val_tau=f"{trainer.last_eval.get('val_tau', float('nan')):.2f}",
        )
        bar.update(1)
        if time.time() - last_ckpt > args.checkpoint_minutes * 60 or trainer.step == trainer.total_steps:
            trainer.checkpoint(card())
            last_ckpt = time.time()
    bar.close()
    log.close()
    if state is not None and trainer.step == state["step"]:
        trainer.checkpoint(card())  # resumed a finished run: refresh the card
    final = card()
    final["session_seconds"] = round(time.time() - started, 1)
    return final


def default_mask_token_id(target) -> int:
    """The first embedding row the tokenizer never emits (Qwen-style padded tables); else the user must choose."""
    n = len(target.tokenizer)
    if n < target.vocab_rows:
        return n
    raise DFlashError(
        f"The target's embedding table has no unused row ({target.vocab_rows} rows, all tokens); "
        "pass --mask-token-id with a special token chat never produces (SmolLM2: 16)."
    )


def train_draft(
    target: str,
    output: str | Path,
    *,
    data: tuple[str, ...] = ("gsm8k", "code"),
    num_samples: int | None = None,
    data_minutes: float | None = None,
    gen_max_new_tokens: int = 192,
    gen_batch_size: int = 64,
    mask_token_id: int | None = None,
    resume: bool = False,
    progress_bar: bool = True,
    command: str | None = None,
    dtype: str = "auto",
    log=print,
    **train_args,
) -> dict:
    """`trtdflash train-draft`: data phase (target answers prompts) then training; returns the training card.

    The draft ends up in <output>/draft (z-lab format, bf16, with training.json). `dtype` (auto, bf16, fp32): the data
    phase's and, unless `bf16` is given, the training's; auto picks each the faster on this CPU.
    """
    from trtllm_dflash.engine.runtime import DTYPES
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.resolve import resolve_target
    from trtllm_dflash.train.data import prepare_data

    out_dir = Path(output).expanduser()
    check_output_dir(out_dir, resume)
    data_dtype = resolve_dtype(dtype)
    train_args.setdefault("bf16", dtype == "bf16" or (dtype == "auto" and trains_in_bf16()))
    args = TrainArgs(**train_args)
    if args.num_layers < 1:
        raise DFlashError(f"--num-layers must be at least 1, got {args.num_layers}.")
    if args.block_size < 2:
        raise DFlashError(f"--block-size must be at least 2 for a draft, got {args.block_size}.")
    if args.steps is not None and args.steps < 1 or args.epochs <= 0:
        raise DFlashError("--steps must be at least 1 and --epochs positive.")
    if args.eval_every < 1:
        raise DFlashError(f"--eval-every must be at least 1, got {args.eval_every}.")
    if args.loss not in DRAFT_LOSSES:
        raise DFlashError(f"--loss must be one of {', '.join(DRAFT_LOSSES)}, got {args.loss!r}.")
    if args.loss == "dpace" and args.logits_chunk % args.block_size:
        raise DFlashError(
            f"--loss dpace needs --block-size to divide {args.logits_chunk} (the LM-head chunk), got {args.block_size}."
        )
    if not 0 <= args.short_blocks <= 1:
        raise DFlashError(f"--short-blocks is a share of the training blocks, from 0 to 1; got {args.short_blocks}.")
    if not 0 <= args.kd <= 1:
        raise DFlashError(f"--kd is the target distribution's share of each label, from 0 to 1; got {args.kd}.")
    if args.lr <= 0 or not math.isfinite(args.lr):
        raise DFlashError(f"--lr must be a positive number, got {args.lr}.")
    if args.max_seq_len < args.block_size + 2:
        raise DFlashError(f"--max-seq-len must exceed the block size, got {args.max_seq_len}.")
    tm = TargetModel.load(resolve_target(target, log), DTYPES[data_dtype])
    if not args.target_layer_ids and args.init_from:  # a grown draft keeps the layers its start draft reads
        args.target_layer_ids = list(read_draft_config(Path(args.init_from)).target_layer_ids)
    if not args.target_layer_ids:
        from trtllm_dflash.config import build_target_layer_ids

        args.target_layer_ids = build_target_layer_ids(tm.num_layers, args.num_layers)
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(tm)
    if not 0 <= mask_token_id < tm.vocab_rows:
        raise DFlashError(
            f"--mask-token-id must be a row of the target's embedding table (0..{tm.vocab_rows - 1}), got {mask_token_id}."
        )
    args.mask_token_id = mask_token_id
    layer_ids = list(args.target_layer_ids)
    if args.kd and tm.num_layers - 1 not in layer_ids:
        layer_ids.append(tm.num_layers - 1)  # the target's distributions come from its last layer's features
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"Data phase: {', '.join(data)} answered by the target into {out_dir / 'data.jsonl'}")
    meta = prepare_data(
        tm,
        tuple(data),
        out_dir,
        layer_ids=layer_ids,
        num_samples=num_samples,
        minutes=data_minutes,
        max_new_tokens=gen_max_new_tokens,
        batch_size=gen_batch_size,
        seed=args.seed,
        progress=log if progress_bar else None,
        frozen=(out_dir / STATE_FILE).is_file(),
    )
    log(f"Training on {sum(meta['records'].values())} records ({meta['response_tokens']} response tokens)")
    card = run_training(tm, out_dir, args, meta, resume, progress_bar=progress_bar, command=command, target_name=target)
    log(f"Draft written to {out_dir / DRAFT_SUBDIR} (val tau {card['final_metrics'].get('val_tau', float('nan')):.2f})")
    return card
