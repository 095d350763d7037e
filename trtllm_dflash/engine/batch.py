"""Speculative generation for many requests at once: draft every row's block in one forward, verify all of
them in one target forward, accept per row.

Requests live in slots of static caches (target K/V and draft context K/V, TensorRT-LLM's per-request slots);
the running rows are always slots 0..n-1, so a step's caches are plain views. Each row keeps its own
position, acceptance, bonus token, budget, stop rules and random generator, so what a request produces does
not depend on what runs beside it. `speculative_stream` is one request through the same step.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Iterator

import torch

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.lookup import MAX_GUESSES, NgramIndex
from trtllm_dflash.engine.plan import batch_sizes
from trtllm_dflash.engine.policy import BlockPolicy
from trtllm_dflash.engine.prefix_cache import BLOCK, CacheListener, Entry, PrefixCache, chunk_ends, chunk_keys
from trtllm_dflash.engine.propose import DraftProposer, LookupProposer
from trtllm_dflash.engine.request import GenerationStats, PendingFeatures, Request
from trtllm_dflash.engine.sampling import greedy, sample, sampling_probs
from trtllm_dflash.engine.step import RowPlan, StepRecord, accept
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.models.draft import DFlashDraftModel, DraftKVCache
from trtllm_dflash.models.draft_ngram import RequestCounts
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.threads import widened

CALIBRATION_ROUNDS = 3  # Batch.calibrate: rounds over every size, the fastest of each kept
STEP_ROUNDS = 3  # Batch.measure_steps: rounds over every draft length, each priced by its median round
# Batch.measure_steps' placeholder prompts: short of a whole prefill chunk (prefix_cache.BLOCK), so none is cached
MEASURE_PROMPT = BLOCK - 16


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
        cache_listener: CacheListener | None = None,
    ):
        """`lookup`: rows whose recent tokens occurred before may verify what followed them instead of drafting.
        `threads`: torch threads for steps and for prompt chunks of WIDE_TOKENS tokens or more (a server's:
        threads.server_threads); None: torch's count for all.
        `prefix`: tokens many prompts start with (the chat template's head: text.shared_prefix), the first of a
        prompt's canonical prefill chunks (prefix_cache.py). Chunks seen before are copied from the prefix cache
        (K/V and draft features; the head always, others within `cache_tokens`). The chunks set the last bits of
        the cache (a forward's attention rounds by its chunk), so every path of an engine passes the same prefix:
        then a prompt's cache holds the same bits alone or served, computed or copied, with a draft or without.
        `cache_listener` hears what the prefix cache keeps and drops (a Dynamo worker's KV events)."""
        self.target, self.draft = target, (draft if block_size > 1 else None)
        self.block_size = block_size if self.draft is not None else 1
        self.lookup = lookup and self.draft is not None
        # With AMX, bf16 linears of more than TILE_ROWS rows take oneDNN's tiles (kernels/packed.py), which round apart
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
        # Where guesses come from, in the order they fill a step's plans (each serves its own rows).
        self.lookup_proposer = LookupProposer(self.max_guesses, target.lm_head.out_features)
        self.proposers: list = [self.lookup_proposer] if self.lookup else []
        if self.draft is not None:
            self.proposers.append(DraftProposer(self.draft, target, self.dcache, self.block_size, self.policy.short))
        self.last_step: StepRecord | None = None  # what the latest step did (step.py)
        self.threads = threads
        self.prefix = list(prefix or [])
        self.prefix_cache = PrefixCache(cache_tokens, cache_listener)

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
                req.features = PendingFeatures()
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
            req.features.add(feats[0], 0, end - start)
        head = i == 0 and req.head > 0
        if head or (
            end - start == BLOCK and self.prefix_cache.max_tokens
        ):  # a whole chunk, kept for prompts that start alike
            k, v = self.cache.read(slot, start, end)
            entry = Entry(k, v, None if feats is None else feats[0].clone())
            self.prefix_cache.put(req.chunk_keys[i], entry, pin=head, prompt=req.prompt_ids, end=end)
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
                req.features.add(entry.features, 0, end - start)
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
            self.dcache.move(src, dst)
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

    @torch.inference_mode()
    def measure_steps(self) -> None:
        """T(rows, K) for the draft-length planner (plan.py): whole steps of 1, 2, 4, ... up to `slots` rows at every
        draft length K (0 = plain decoding), rows of placeholder requests removed after. A whole step pays what no
        single forward shows (the draft's context update, each row's attention, the bookkeeping), and it is what the
        plan trades.

        The plan compares lengths at one batch size, so what must hold is each length's cost relative to the plain
        step. Each round steps every draft length once (the order reversed each round), each between two plain steps,
        and a length costs the fastest plain step times the median over STEP_ROUNDS rounds of its seconds over the
        mean of the plain steps either side: a slower spell of the machine (another process running) mostly spans a
        length and its neighbours and cancels, and a spike or a one-off setup lands in one round and is outvoted.
        Each length's own fastest would price it by whichever moment happened to be quiet for it, and on a busy
        machine plan plain decoding where drafting pays. No length is left costing more than a longer one; acceptance
        is not learnt here."""
        assert not self.rows, "measure steps before admitting requests"
        if self.draft is None:
            return
        seconds: dict[tuple[int, int], float] = {}
        budget = STEP_ROUNDS * self.block_size * (self.block_size + 1)  # more tokens than STEP_ROUNDS rounds commit
        lengths = list(range(1, self.block_size))

        def timed(k: int, b: int) -> float:
            t0 = time.perf_counter()
            self.step([k + 1] * b, observe=False)
            return time.perf_counter() - t0

        for b in batch_sizes(self.slots):
            reqs = [Request([0] * MEASURE_PROMPT, budget) for _ in range(b)]
            for r in reqs:
                while not self.add(r):
                    pass
            plain, ratios = [timed(0, b)], {k: [] for k in lengths}
            for _ in range(STEP_ROUNDS):
                for k in lengths:
                    took = timed(k, b)
                    plain.append(timed(0, b))
                    ratios[k].append(2 * took / (plain[-2] + plain[-1]))
                lengths.reverse()
            for r in reqs:
                self.remove(r)
            cost = {0: min(plain)} | {k: min(plain) * statistics.median(r) for k, r in ratios.items()}
            for k in reversed(range(self.block_size)):  # a longer step never costs less
                seconds[b, k] = min(cost[k], seconds.get((b, k + 1), cost[k]))
        self.policy.step_seconds = seconds
        self.policy.replan()

    @property
    def ready(self) -> list[Request]:
        """Rows past prefill and not finished: the ones a step advances."""
        return [r for r in self.rows if r.prefilled == len(r.prompt_ids) and not r.stats.finish_reason]

    @torch.inference_mode()
    def step(self, ks: list[int] | None = None, observe: bool = True) -> dict[Request, list[int]]:
        """One speculative step for every ready row (they must be slots 0..n-1): plan, propose, verify, accept, commit.
        Each row has its own block length k_i (1 = plain decoding); the verify forward carries sum(k_i) tokens.
        `ks`: the rows' block lengths, drafted (else the policy's choice); `observe`: the policy learns from the step."""
        rows = self.ready
        assert rows == self.rows[: len(rows)], "ready rows must lead the slots"
        plans = self._plan(rows) if ks is None else [RowPlan(r, min(k, max(r.remaining, 1))) for r, k in zip(rows, ks)]
        t0 = time.perf_counter()
        proposing = any(p.k > 1 for p in plans)  # else every row decodes plainly: nothing to propose
        width = max((proposer.propose(plans) for proposer in self.proposers if proposing), default=0)
        t1 = time.perf_counter()
        row_logits, posterior, feats = self._verify(plans)
        for plan, logits, post in zip(plans, row_logits, posterior):
            accept(plan, logits, post)
        out = self._commit(plans, feats)
        record = StepRecord.of(plans, [len(out[r]) for r in rows], width, t1 - t0, time.perf_counter() - t1)
        if observe:
            self.policy.observe(rows, record)
        self.last_step = record
        return out

    def _plan(self, rows: list[Request]) -> list[RowPlan]:
        """Each row's block length within its budget (the policy's choice), and whether it verifies prompt lookup's
        candidates instead of drafting. A greedy drafting row below the full block also drafts one slot beyond it:
        not verified, but where every guess is accepted the bonus token tells whether it was right, and the policy
        learns that slot's acceptance from it instead of from other requests' (a row held at k=2 learns whether k=3
        pays)."""
        on = self.policy.speculates(len(rows))  # else no row's candidates are looked up, nor its n-grams counted
        found = [self.lookup_proposer.candidates(r.history) if on else [] for r in rows]
        ks, looked = self.policy.choose(rows, [len(f) for f in found])
        plans = [RowPlan(r, k, lk, f if lk else []) for r, k, lk, f in zip(rows, ks, looked, found)]
        for p in plans:
            p.spare = self.policy.adaptive and p.drafting and p.k < self.block_size and p.req.sampling.greedy
        return plans

    def _verify(self, plans: list[RowPlan]):
        """[token, guesses] of every row at positions start..start+k-1, all rows in one target forward; min_tokens
        applied to the target's logits. Returns per-row logits and argmaxes, and the features the draft needs."""
        ks = [p.k for p in plans]
        logits, feats = self.target.forward_rows(
            [[p.req.token] + p.guesses for p in plans],
            [p.req.start for p in plans],
            self.cache,
            capture=self.draft is not None,
        )
        row_logits = logits.split(ks)
        for p, lg in zip(plans, row_logits):
            p.req.hold_stops(lg, p.req.stats.num_tokens)
        return row_logits, greedy(logits).split(ks), feats

    def _commit(self, plans: list[RowPlan], feats: torch.Tensor | None) -> dict[Request, list[int]]:
        """Accepted guesses and the bonus token become each row's output; its position moves past them (the cache
        beyond is stale: the next forward overwrites it), and the draft gets the committed tokens' features (the token
        and the accepted guesses: the first a + 1 of the row's k in `feats`)."""
        out, offset = {}, 0
        for p in plans:
            r, a = p.req, p.accepted
            r.stats.add_step(p.k, a, p.looked)
            out[r] = r.commit(p.guesses[:a] + [p.bonus])
            if feats is not None:
                r.features.add(feats, offset, a + 1)
            r.start += a + 1
            r.token = p.bonus
            offset += p.k
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
