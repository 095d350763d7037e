"""Speculative generation for many requests at once: draft every row's block in one forward, verify all of
them in one target forward, accept per row.

Requests live in slots of static caches (target K/V and draft context K/V, TensorRT-LLM's per-request slots);
the running rows are always slots 0..n-1, so a step's caches are plain views. Each row keeps its own
position, acceptance, bonus token, budget, stop rules and random generator, so what a request produces does
not depend on what runs beside it. `speculative_stream` is one request through the same step.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.lookup import MAX_GUESSES, NgramIndex
from trtllm_dflash.engine.policy import BlockPolicy
from trtllm_dflash.engine.prefix_cache import BLOCK, Entry, PrefixCache, chunk_ends, chunk_keys
from trtllm_dflash.engine.sampling import greedy, rejection_sample, sample, sampling_probs
from trtllm_dflash.models import bf16_gemm
from trtllm_dflash.models.draft import DFlashDraftModel, DraftKVCache
from trtllm_dflash.models.draft_ngram import RequestCounts
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.threads import widened

CALIBRATION_ROUNDS = 3  # Batch.calibrate: rounds over every size, the fastest of each kept


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (prefix_cache.py)
    num_tokens: int = 0
    steps: int = 0  # target verify forwards after prefill
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_counts_estimated: bool = False  # drafted/accepted inferred from iteration counts, not counted by the engine
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps whose draft j+1 was accepted
    lookup_steps: int = 0  # steps that verified lookup guesses instead of the draft's (lookup.py)
    lookup_accepted: int = 0  # ... and the guesses of theirs accepted
    block_lengths: dict[int, int] = field(default_factory=dict)  # block length the policy chose -> steps
    time_to_first_token: float = 0.0
    wall_time: float = 0.0
    finish_reason: str = ""

    @property
    def acceptance_length(self) -> float:
        """tau: committed tokens per target verify forward, bonus included (1.0 = autoregressive)."""
        decoded = self.num_tokens - 1  # the first token comes from the prefill
        return decoded / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "num_tokens": self.num_tokens,
            "steps": self.steps,
            "acceptance_length": round(self.acceptance_length, 4),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "lookup_steps": self.lookup_steps,
            "lookup_accepted": self.lookup_accepted,
            "block_lengths": {str(k): v for k, v in sorted(self.block_lengths.items())},
            "time_to_first_token": round(self.time_to_first_token, 4),
            "wall_time": round(self.wall_time, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "finish_reason": self.finish_reason,
        }


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)


class Request:
    """One generation: its inputs, its place in the sequence and what it has committed."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: frozenset[int] = frozenset(),
        min_tokens: int = 0,
        stats: GenerationStats | None = None,
    ):
        self.prompt_ids, self.sampling, self.min_tokens = list(prompt_ids), sampling, min_tokens
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids, self.stop_list = stop_token_ids, sorted(stop_token_ids)
        self.stats = stats if stats is not None else GenerationStats()
        self.gen = _generator(sampling.seed)
        self.t0 = time.perf_counter()
        self.start = 0  # position of `token`: committed, not yet fed to the target
        self.token = -1
        self.prefilled = 0  # prompt tokens already in the target cache (chunked prefill)
        self.head = 0  # tokens of the chat template's head it starts with: its first chunk, pinned in the prefix cache
        self.chunk_ends: list[int] = []  # where its canonical prefill chunks end, and their prefix-cache keys
        self.chunk_keys: list[bytes] = []
        self.history: NgramIndex | None = None  # prompt and committed tokens, where the batch looks guesses up
        self.counts: RequestCounts | None = (
            None  # prompt and committed tokens' n-grams, where the draft's prior reads them
        )

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.stats.num_tokens

    def hold_stops(self, logits: torch.Tensor, first: int) -> torch.Tensor:
        """min_tokens: stop tokens get probability 0 at the rows (row j predicts generated token first + j) that come
        too early; the target's distribution is what changes, so verification stays exact."""
        rows = self.min_tokens - first
        if rows > 0 and self.stop_list:
            logits[:rows, self.stop_list] = float("-inf")
        return logits

    def commit(self, tokens: list[int]) -> list[int]:
        """Append decided tokens, cut at the first stop token and at the budget."""
        stats, out = self.stats, []
        for t in tokens[: self.remaining]:
            out.append(t)
            if t in self.stop_token_ids:
                stats.finish_reason = "stop"
                break
        stats.num_tokens += len(out)
        if self.counts is not None:
            self.counts.extend(out)
        if self.history is not None:
            self.history.extend(out)
        if not stats.finish_reason and stats.num_tokens >= self.max_new_tokens:
            stats.finish_reason = "length"
        stats.wall_time = time.perf_counter() - self.t0
        return out


class Batch:
    """The running requests of one engine and their caches; `add`, `step` and `remove` between steps."""

    def __init__(
        self,
        target: TargetModel,
        draft: DFlashDraftModel | None,
        block_size: int,
        slots: int = 1,
        policy: BlockPolicy | None = None,
        lookup: bool = True,
        threads: tuple[int, int] | None = None,
        prefix: list[int] | None = None,
        cache_tokens: int = 0,
    ):
        """`lookup`: rows whose recent tokens occurred before may verify what followed them instead of drafting.
        `threads`: torch threads for steps and for prompt chunks of WIDE_TOKENS tokens or more (a server's:
        threads.server_threads); None: torch's count for all.
        `prefix`: tokens many prompts start with (the chat template's head: runtime.shared_prefix), the first of a
        prompt's canonical prefill chunks (prefix_cache.py). Chunks seen before are copied from the prefix cache
        (K/V and draft features; the head always, others within `cache_tokens`). The chunks set the last bits of
        the cache (a forward's attention rounds by its chunk), so every path of an engine passes the same prefix:
        then a prompt's cache holds the same bits alone or served, computed or copied, with a draft or without."""
        self.target, self.draft = target, (draft if block_size > 1 else None)
        self.block_size = block_size if self.draft is not None else 1
        self.lookup = lookup and self.draft is not None
        # With AMX, bf16 linears of more than TILE_ROWS rows take oneDNN's tiles (models/packed.py), which round apart
        # from a decode step: there a lookup block stays within TILE_ROWS, so a request alone writes what plain
        # decoding writes (as the draft's blocks of 8 do).
        tiled = target.dtype == torch.bfloat16 and bf16_gemm.tiles()
        self.max_guesses = min(MAX_GUESSES, bf16_gemm.TILE_ROWS - 1) if tiled else MAX_GUESSES
        self.policy = policy or BlockPolicy(
            self.block_size, short=self.draft is not None and self.draft.config.short_blocks > 0
        )
        self.rows: list[Request] = []  # row i is slot i
        self.cache = target.new_cache(slots)
        self.dcache = DraftKVCache(draft.config, slots, 256, target.dtype) if self.draft is not None else None
        self.slots = slots
        self.last_step: tuple[list[int], int, int, int, int] = ([], 0, 0, 0, 0)
        self.threads = threads
        self.prefix = list(prefix or [])
        self.prefix_cache = PrefixCache(cache_tokens)

    @torch.inference_mode()
    def add(self, req: Request) -> list[int]:
        """Prefill `req` into the next free slot, one canonical chunk a call (the chunks before it that the prefix
        cache holds copied in first); returns its first token once the prompt is in."""
        n = len(req.prompt_ids)
        if req not in self.rows:
            assert len(self.rows) < self.slots, "no free slot"
            req.max_new_tokens = min(req.max_new_tokens, self.target.max_positions - n)
            req.stats.prompt_tokens = n
            req.stats.accepted_per_position = [0] * max(self.block_size - 1, self.max_guesses if self.lookup else 0)
            self.rows.append(req)
            if self.lookup:
                req.history = NgramIndex(req.prompt_ids)
            if self.draft is not None and self.draft.ngram is not None and req.sampling.greedy:
                req.counts = RequestCounts(req.prompt_ids)
            if self.dcache is not None:
                self.dcache.lengths[len(self.rows) - 1] = 0
            p = len(self.prefix)
            req.head = p if 0 < p < n and req.prompt_ids[:p] == self.prefix else 0
            req.chunk_ends = chunk_ends(n, req.head)
            req.chunk_keys = chunk_keys(req.prompt_ids, req.chunk_ends)
            self._copy_cached(req)
        slot = self.rows.index(req)
        i = bisect.bisect_right(req.chunk_ends, req.prefilled)  # the chunk that starts at `prefilled`
        start, end = req.prefilled, req.chunk_ends[i]
        with widened(self.threads, end - start):
            logits, feats = self.target.forward(
                torch.tensor([req.prompt_ids[start:end]]),
                start,
                self.cache,
                capture=self.draft is not None,
                logits_to_keep=1,
                first_slot=slot,
            )
        req.prefilled = end
        if feats is not None:
            self.dcache.stage(torch.full((end - start,), slot), torch.arange(start, end), feats[0])
        head = i == 0 and req.head > 0
        if head or (
            end - start == BLOCK and self.prefix_cache.max_tokens
        ):  # a whole chunk, kept for prompts that start alike
            k, v = self.cache.read(slot, start, end)
            self.prefix_cache.put(req.chunk_keys[i], Entry(k, v, None if feats is None else feats[0].clone()), pin=head)
        if end < n:
            return []
        row = req.hold_stops(logits[0, -1:], 0)  # [1, V]
        req.token = int(
            greedy(row)[0] if req.sampling.greedy else sample(sampling_probs(row, req.sampling), req.gen)[0]
        )
        req.start = n
        req.stats.time_to_first_token = time.perf_counter() - req.t0
        return req.commit([req.token])

    def _copy_cached(self, req: Request) -> None:
        """The prompt's leading chunks the prefix cache holds, into its slot (never its last chunk: that forward gives
        the first token)."""
        slot, start = self.rows.index(req), 0
        for end, key in zip(req.chunk_ends[:-1], req.chunk_keys):
            entry = self.prefix_cache.get(key)
            if entry is None:
                break
            self.cache.write(slot, start, entry.keys, entry.values)
            if entry.features is not None:
                self.dcache.stage(torch.full((end - start,), slot), torch.arange(start, end), entry.features)
            start = end
        req.prefilled = req.stats.cached_tokens = start

    @torch.inference_mode()
    def remove(self, req: Request) -> None:
        """Free req's slot; the last row moves into it so running rows stay slots 0..n-1. If that row's prompt is still
        going in (a prompt of three chunks or more, between them), the last running row moves instead and the prompt
        follows it: moved into a running row's place, it would stand between running rows."""
        i, last = self.rows.index(req), len(self.rows) - 1
        if i < last - 1 and self.rows[last].prefilled < len(self.rows[last].prompt_ids):
            self._move(last - 1, i)
            self._move(last, last - 1)
        elif i != last:
            self._move(last, i)
        self.rows.pop()

    def _move(self, src: int, dst: int) -> None:
        moved = self.rows[src]
        self.cache.move(src, dst, max(moved.start, moved.prefilled))
        if self.dcache is not None:
            self.dcache.move(src, dst, max(moved.start, moved.prefilled))
        self.rows[dst] = moved

    @torch.inference_mode()
    def calibrate(self, max_rows: int) -> None:
        """Measure draft and verify forwards of 1, 2, 4, ... tokens up to a full step of `max_rows` rows (verify: or a
        row's lookup guesses, if longer), for the policy. Draft forwards are shaped as steps draft: rows of whole blocks,
        and with a draft trained on short blocks also one row of every width up to a block (our kernels take rows in
        pairs, so an odd width costs about as much as the even one above it: interpolation would miss that).

        The sizes take turns, CALIBRATION_ROUNDS rounds of all of them, and each keeps its fastest: the policy learns a
        size's cost relative to the others only by choosing it, so a burst of contention that inflated some sizes
        alone (a server's other models loading beside this one) would hold it at short blocks for good (in-process,
        4 tokens and more priced 1.5x after calibration held GSM8K at 2-token blocks, acceptance 1.3 against 2.5).
        Runs in slot 0 before any request is admitted (whatever it writes there is overwritten by the next prefill).
        """
        assert not self.rows, "calibrate before admitting requests"
        full = max_rows * self.block_size
        top = max(full, 1 + self.max_guesses if self.lookup else 0)
        sizes = sorted({min(2**i, top) for i in range(top.bit_length() + 1)})
        verify = {n: float("inf") for n in sizes}
        shapes = {}  # drafted slots -> (rows, slots each)
        if self.draft is not None:
            shapes = {n: (n // self.block_size, self.block_size) for n in sizes if self.block_size <= n <= full}
            if self.policy.short:
                shapes.update({w: (1, w) for w in range(2, self.block_size + 1)})
        draft = {n: float("inf") for n in shapes}
        for _ in range(
            CALIBRATION_ROUNDS
        ):  # the first run of a shape pays one-off setup; the fastest is the machine's cost
            for n in sorted(set(sizes) | set(shapes)):
                t1 = time.perf_counter()
                if n in verify:
                    self.target.forward(
                        torch.zeros(1, n, dtype=torch.long), 0, self.cache, capture=self.draft is not None
                    )
                    verify[n] = min(verify[n], time.perf_counter() - t1)
                    t1 = time.perf_counter()
                if n in shapes:
                    rows, width = shapes[n]  # width - 1 guesses a row to the LM head
                    x = self.draft.embed_block(self.target.embed_tokens, torch.zeros(rows, width, dtype=torch.long))
                    c = self.dcache.k[:, :1, :, :0].expand(-1, rows, -1, -1, -1)
                    hidden = self.draft.draft_block(
                        x, torch.arange(width).expand(rows, -1), c, c, torch.zeros(rows, dtype=torch.long)
                    )
                    self.draft.compute_logits(
                        hidden[:, 1:].reshape(1, -1, hidden.shape[-1]), self.target.lm_head, full=False
                    )
                    draft[n] = min(draft[n], time.perf_counter() - t1)
        for n in sorted(set(sizes) | set(shapes)):
            self.policy.record_cost(n, draft.get(n), verify.get(n))

    @property
    def ready(self) -> list[Request]:
        """Rows past prefill and not finished: the ones a step advances."""
        return [r for r in self.rows if r.prefilled == len(r.prompt_ids) and not r.stats.finish_reason]

    def _update_draft_context(self, rows: list[Request], which: list[int]) -> None:
        """Context K/V of the pending features (positions committed since the row last drafted) of rows[i] for i in
        `which`: one GEMM over all of them, written into each row's slot."""
        dc, slots, positions = self.dcache, [], []
        for i in which:
            lo, hi = dc.lengths[i], rows[i].start
            if hi > lo:
                slots.append(torch.full((hi - lo,), i))
                positions.append(torch.arange(lo, hi))
                dc.lengths[i] = hi
        if slots:
            slots, positions = torch.cat(slots), torch.cat(positions)
            k, v = self.draft.context_kv(
                self.draft.project_context(dc.features[slots, positions][None]), positions[None]
            )
            dc.write(slots, positions, k, v)

    @torch.inference_mode()
    def step(self) -> dict[Request, list[int]]:
        """One speculative step for every ready row (they must be slots 0..n-1): draft, verify, accept, commit.

        Each row has its own block length k_i (1 = plain decoding); the verify forward carries sum(k_i) tokens.
        """
        rows = self.ready
        assert rows == self.rows[: len(rows)], "ready rows must lead the slots"
        n, draft, target = len(rows), self.draft, self.target
        # Lookup guesses: what followed the last few tokens where they occurred before (none without a draft).
        found = [r.history.propose(self.max_guesses) if r.history is not None else [] for r in rows]
        ks, looked = self.policy.choose(rows, [len(f) for f in found])  # block length per row, within its budget
        drafting = [i for i, k in enumerate(ks) if k > 1 and not looked[i]]
        drafts, q = (
            [[] for _ in rows],
            [None] * n,
        )  # row i's guesses for positions start+1..start+k_i-1 (and their probs)
        # A greedy drafting row also guesses one slot beyond its block (one slot more of the draft's forward): not
        # verified, but where every guess is accepted the bonus token tells whether it was right, and the policy learns
        # that slot's acceptance from it instead of from other requests' (a row held at k=2 learns whether k=3 pays).
        learns = self.policy.adaptive
        spare = [
            int(learns and i in drafting and ks[i] < self.block_size and rows[i].sampling.greedy) for i in range(n)
        ]
        spare_guess: list[int | None] = [None] * n
        beyond: list[bool | None] = [None] * n  # whether row i's spare guess was right, where all its guesses were
        for i in (i for i, lk in enumerate(looked) if lk):
            drafts[i] = found[i][: ks[i] - 1]
            if not rows[i].sampling.greedy:  # a fixed guess is a draft distribution with all its mass on it
                q[i] = torch.zeros(len(drafts[i]), target.lm_head.out_features)
                q[i][torch.arange(len(drafts[i])), drafts[i]] = 1.0
        # Slots drafted per row: the block's attention is bidirectional, so fewer mask slots change every guess; a draft
        # trained on whole blocks drafts all of them whatever k_i is, one trained on short blocks too (policy.short)
        # only the slots the longest block and its spare need. Only k_i-1 guesses (and the spare) reach the LM head.
        width = max((ks[i] + spare[i] for i in drafting), default=0) if self.policy.short else self.block_size
        t0 = time.perf_counter()
        if drafting:
            # Draft: context K/V of newly committed tokens, then one block forward for the drafting rows.
            self._update_draft_context(rows, drafting)
            idx = torch.tensor(drafting)
            starts = torch.tensor([rows[i].start for i in drafting])
            block = torch.full((len(drafting), width), draft.config.mask_token_id)
            block[:, 0] = torch.tensor([rows[i].token for i in drafting])
            c = int(starts.max())
            ck, cv = self.dcache.k[:, :n, :, :c], self.dcache.v[:, :n, :, :c]
            if len(drafting) < n:
                ck, cv = ck[:, idx], cv[:, idx]
            hidden = draft.draft_block(
                draft.embed_block(target.embed_tokens, block), starts[:, None] + torch.arange(width), ck, cv, starts
            )
            guesses = torch.cat(
                [hidden[d, 1 : ks[i] + spare[i]] for d, i in enumerate(drafting)]
            )  # [sum(k_i - 1 + spare_i), H]
            vocab = draft.vocab_token_ids  # the draft guesses among these tokens (None: all)
            draft_logits = draft.compute_logits(guesses[None], target.lm_head, full=False)[0].split(
                [ks[i] - 1 + spare[i] for i in drafting]
            )
            for i, logits in zip(drafting, draft_logits):
                r = rows[i]
                if r.counts is not None:  # greedy, re-weighted by what the target writes after them (n-gram prior)
                    drafts[i] = draft.ngram.greedy(logits, r.counts, vocab)
                elif (
                    r.sampling.greedy
                ):  # argmax over the vocabulary's columns (a stop token held back is rejected in verify)
                    guess = greedy(logits)
                    drafts[i] = (guess if vocab is None else vocab[guess]).tolist()
                else:
                    q[i] = sampling_probs(r.hold_stops(draft.to_full_vocab(logits), r.stats.num_tokens), r.sampling)
                    drafts[i] = sample(q[i], r.gen).tolist()
                if spare[i]:
                    spare_guess[i] = drafts[i].pop()
        t1 = time.perf_counter()
        # Verify [token, d_1..d_{k_i-1}] of every row at positions start..start+k_i-1, all rows in one target forward.
        logits, feats = target.forward_rows(
            [[r.token] + drafts[i] for i, r in enumerate(rows)],
            [r.start for r in rows],
            self.cache,
            capture=draft is not None,
        )
        row_logits = logits.split(ks)
        for r, lg in zip(rows, row_logits):
            r.hold_stops(lg, r.stats.num_tokens)
        posterior = greedy(logits).split(ks)
        out, accepted, offset, kept = (
            {},
            [],
            0,
            [],
        )  # kept: (slot, position, flat index) of each committed token's features
        for i, r in enumerate(rows):
            k, s = ks[i], r.stats
            if (
                r.sampling.greedy
            ):  # accept the longest prefix of drafts the target agrees with; its next argmax is the bonus
                post = posterior[i].tolist()
                a = 0
                while a < k - 1 and drafts[i][a] == post[a]:
                    a += 1
                bonus = post[a]
            else:
                a, bonus = rejection_sample(
                    torch.tensor(drafts[i], dtype=torch.long),
                    sampling_probs(row_logits[i], r.sampling),
                    q[i] if q[i] is not None else torch.empty(0, 0),
                    r.gen,
                )
            accepted.append(a)
            if spare_guess[i] is not None and a == k - 1:
                beyond[i] = spare_guess[i] == bonus
            s.steps += 1
            s.drafted_tokens += k - 1
            s.accepted_tokens += a
            s.block_lengths[k] = s.block_lengths.get(k, 0) + 1
            if looked[i]:
                s.lookup_steps += 1
                s.lookup_accepted += a
            for j in range(a):
                s.accepted_per_position[j] += 1
            out[r] = r.commit(drafts[i][:a] + [bonus])
            kept += [(i, r.start + j, offset + j) for j in range(a + 1)]  # token + accepted drafts
            r.start += a + 1  # the cache beyond start is stale: the next forward overwrites it
            r.token = bonus
            offset += k
        if feats is not None:
            slot, position, index = torch.tensor(kept).unbind(1)
            self.dcache.stage(slot, position, feats[index])
        self.policy.observe(
            rows,
            ks,
            accepted,
            draft_seconds=t1 - t0,
            verify_seconds=time.perf_counter() - t1,
            looked=looked,
            beyond=beyond,
            width=width,
        )
        # for metrics: block lengths, guesses verified and accepted, rows that verified lookup guesses and theirs accepted
        self.last_step = (ks, sum(ks) - n, sum(accepted), sum(looked), sum(a for a, lk in zip(accepted, looked) if lk))
        return out


@torch.inference_mode()
def speculative_stream(
    target: TargetModel,
    draft: DFlashDraftModel | None,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int,
    sampling: SamplingParams,
    stop_token_ids: frozenset[int],
    stats: GenerationStats,
    min_tokens: int = 0,
    policy: BlockPolicy | None = None,
    lookup: bool = True,
    prefix: list[int] | None = None,
) -> Iterator[list[int]]:
    """One request alone: yield committed tokens as they are decided. block_size 1 (or no draft) is plain decoding.

    The block length is `block_size` every step unless a `policy` is given; `prefix` as in Batch.
    """
    batch = Batch(target, draft, block_size, slots=1, policy=policy, lookup=lookup, prefix=prefix)
    req = Request(prompt_ids, max_new_tokens, sampling, stop_token_ids, min_tokens, stats)
    first = batch.add(req)
    while not first and req.prefilled < len(prompt_ids):
        first = batch.add(req)
    yield first
    while not stats.finish_reason:
        yield batch.step()[req]
