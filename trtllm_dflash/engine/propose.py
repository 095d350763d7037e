"""The propose phase: where a step's guesses come from. Each proposer fills `guesses` (and, for a sampled row, `q`) of
the plans it serves and returns how many slots a row of it computed, for the cost model; verify and accept do not
know which proposer a guess came from (vLLM's proposers and TensorRT-LLM's drafters are built the same way).
"""

from __future__ import annotations

import torch

from trtllm_dflash.engine.lookup import NgramIndex
from trtllm_dflash.engine.sampling import greedy, sample, sampling_probs
from trtllm_dflash.engine.step import RowPlan
from trtllm_dflash.models.draft import DFlashDraftModel, DraftKVCache
from trtllm_dflash.models.target import TargetModel


class LookupProposer:
    """Prompt lookup (lookup.py): what followed the row's last few tokens where they occurred before. Its candidates
    are known before the block lengths are chosen (the policy prices them), so `candidates` runs in the plan phase."""

    def __init__(self, max_guesses: int, vocab_rows: int):
        self.max_guesses, self.vocab_rows = max_guesses, vocab_rows

    def candidates(self, history: NgramIndex | None) -> list[int]:
        return history.propose(self.max_guesses) if history is not None else []

    def propose(self, plans: list[RowPlan]) -> int:
        for p in plans:
            if not p.looked:
                continue
            p.guesses = p.found[: p.k - 1]
            if not p.req.sampling.greedy:  # a fixed guess is a draft distribution with all its mass on it
                p.q = torch.zeros(len(p.guesses), self.vocab_rows)
                p.q[torch.arange(len(p.guesses)), p.guesses] = 1.0
        return 0


class DraftProposer:
    """The DFlash draft: every drafting row's block in one forward, conditioned on the target's features through the
    draft's context K/V (kept per slot in `dcache`).

    A block's attention is bidirectional, so fewer mask slots change every guess: a draft trained on whole blocks
    drafts all of them whatever k is; one trained on short blocks too (`short`, DraftConfig.short_blocks) only the
    slots the longest block and its spare need. Only k - 1 guesses (and the spare) reach the LM head."""

    def __init__(
        self, draft: DFlashDraftModel, target: TargetModel, dcache: DraftKVCache, block_size: int, short: bool
    ):
        self.draft, self.target, self.dcache = draft, target, dcache
        self.block_size, self.short = block_size, short

    def update_context(self, reqs: list, which: list[int]) -> None:
        """Context K/V of the pending features (positions committed since the row last drafted) of reqs[i] for i in
        `which`: one GEMM over all of them, written into each row's slot."""
        dc, slots, positions, features = self.dcache, [], [], []
        for i in which:
            r, lo = reqs[i], dc.lengths[i]
            if r.start > lo:
                assert r.features.tokens == r.start - lo, "pending features must cover the slot's missing context"
                slots.append(torch.full((r.start - lo,), i))
                positions.append(torch.arange(lo, r.start))
                features.append(r.features.tensor())
                r.features.clear()
                dc.lengths[i] = r.start
        if slots:
            slots, positions = torch.cat(slots), torch.cat(positions)
            k, v = self.draft.context_kv(self.draft.project_context(torch.cat(features)[None]), positions[None])
            dc.write(slots, positions, k, v)

    def propose(self, plans: list[RowPlan]) -> int:
        draft, n = self.draft, len(plans)
        drafting = [i for i, p in enumerate(plans) if p.drafting]
        width = max((plans[i].k + plans[i].spare for i in drafting), default=0) if self.short else self.block_size
        if not drafting:
            return width
        self.update_context([p.req for p in plans], drafting)
        starts = torch.tensor([plans[i].req.start for i in drafting])
        block = torch.full((len(drafting), width), draft.config.mask_token_id)
        block[:, 0] = torch.tensor([plans[i].req.token for i in drafting])
        c = int(starts.max())
        ck, cv = self.dcache.k[:, :n, :, :c], self.dcache.v[:, :n, :, :c]
        if len(drafting) < n:
            idx = torch.tensor(drafting)
            ck, cv = ck[:, idx], cv[:, idx]
        hidden = draft.draft_block(
            draft.embed_block(self.target.embed_tokens, block), starts[:, None] + torch.arange(width), ck, cv, starts
        )
        sizes = [plans[i].k - 1 + plans[i].spare for i in drafting]
        guesses = torch.cat([hidden[d, 1 : 1 + size] for d, size in enumerate(sizes)])  # [sum(sizes), H]
        vocab = draft.vocab_token_ids  # the draft guesses among these tokens (None: all)
        logits = draft.compute_logits(guesses[None], self.target.lm_head, full=False)[0].split(sizes)
        for i, lg in zip(drafting, logits):
            p, r = plans[i], plans[i].req
            if r.counts is not None:  # greedy, re-weighted by what the target writes after them (n-gram prior)
                p.guesses = draft.ngram.greedy(lg, r.counts, vocab)
            elif r.sampling.greedy:  # argmax over the vocabulary's columns (a stop token held back is rejected later)
                guess = greedy(lg)
                p.guesses = (guess if vocab is None else vocab[guess]).tolist()
            else:
                p.q = sampling_probs(r.hold_stops(draft.to_full_vocab(lg), r.stats.num_tokens), r.sampling)
                p.guesses = sample(p.q, r.gen).tolist()
            if p.spare:
                p.spare_guess = p.guesses.pop()
        return width
