"""The embedded PyTorch runtime: target + draft + tokenizer, text in, text out (streaming).

This is what `trtdflash generate` and the Triton `dflash` model both call.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trtllm_dflash.config import SPECULATION, EngineOptions, SamplingParams
from trtllm_dflash.cpu import resolve_dtype
from trtllm_dflash.engine.batch import Batch, speculative_stream
from trtllm_dflash.engine.plan import conditional_for_tau
from trtllm_dflash.engine.policy import OPTIMISTIC, BlockPolicy
from trtllm_dflash.engine.prefix_cache import DEFAULT_TOKENS as PREFIX_CACHE_TOKENS
from trtllm_dflash.engine.prefix_cache import CacheListener
from trtllm_dflash.engine.request import GenerationStats, Request
from trtllm_dflash.engine.scheduler import Scheduler
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import held_out_tau, load_draft, read_draft_config, refuse_dflash2
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.draft_ngram import read_draft_ngram
from trtllm_dflash.models.draft_vocab import read_draft_vocab
from trtllm_dflash.models.speculators import resolve_any_draft
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import resolve_target
from trtllm_dflash.text import IncrementalDetokenizer, encode_prompt, shared_prefix
from trtllm_dflash.threads import server_threads
from trtllm_dflash.validate import validate_block_size, validate_pair

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _with_stats(events, stats: GenerationStats):
    """(tokens, statistics snapshot) events -> tokens, with `stats` brought up to each snapshot first."""
    try:
        for tokens, snapshot in events:
            stats.__dict__.update(snapshot.__dict__)
            yield tokens
    finally:
        events.close()


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class DFlashEngine:
    def __init__(
        self,
        target: TargetModel,
        draft: DFlashDraftModel | None,
        block_size: int,
        speculation: str = "adaptive",
        draft_tau: float | None = None,
        lookup: bool = True,
    ):
        """`draft_tau`: the draft card's held-out acceptance length, which bounds what the policy expects of a probe.
        `lookup`: where a row's last tokens occurred before, verify what followed them instead of drafting (lookup.py)."""
        self.target, self.draft, self.block_size = target, draft, block_size
        self.lookup = lookup and draft is not None  # a build without a draft decodes plainly: nothing to look up for
        self.tokenizer = target.tokenizer
        self.prefix = shared_prefix(self.tokenizer, target.max_positions) if self.tokenizer is not None else []
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        gen_cfg = getattr(target.model, "generation_config", None)
        gen_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        ids = {eos} | (set(gen_eos) if isinstance(gen_eos, list) else {gen_eos})
        self.eos_token_ids = frozenset(i for i in ids if i is not None)
        if speculation not in SPECULATION:
            raise DFlashError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}.")
        block = block_size if draft is not None else 1
        ceiling = OPTIMISTIC if draft_tau is None else conditional_for_tau(draft_tau, block)
        self.policy = BlockPolicy(
            block,
            adaptive=speculation == "adaptive",
            ragged=target.ragged,
            ceiling=ceiling,
            short=block > 1 and draft.config.short_blocks > 0,
            planned=speculation == "planned",
        )
        self._calibrated_rows = self._measured_rows = 0  # rows the policy's forwards and whole steps were measured to

    @property
    def dtype(self) -> str:
        return next(name for name, dt in DTYPES.items() if dt == self.target.dtype)

    @property
    def target_weights(self) -> str:
        """What the target's linears multiply: "4-bit" where load() took its weights as shipped, else the dtype."""
        return "4-bit" if self.target.four_bit else self.dtype

    @property
    def draft_weights(self) -> str | None:
        """What the draft's weights are kept as ("int8" where load() chose it, else the dtype); None without a draft."""
        return None if self.draft is None else "int8" if self.draft.int8 else self.dtype

    @classmethod
    def load(
        cls,
        target: str,
        draft: str | None = None,
        *,
        no_draft: bool = False,
        dtype: str = "auto",
        block_size: int | None = None,
        speculation: str = "adaptive",
        draft_vocab: bool = True,
        lookup: bool = True,
        draft_ngram: bool = True,
        int8_draft: bool = True,
        weights: str = "auto",
        progress=print,
    ) -> DFlashEngine:
        """`draft_vocab`: use the draft's vocabulary file (models/draft_vocab.py) where it has one; `draft_ngram` its
        n-gram prior on greedy guesses (models/draft_ngram.py); `int8_draft`: keep a bf16 draft's weights as int8
        where our kernel multiplies them (bf16_gemm.int8_weights: on AVX2 alone), verification keeping the output the
        target's. `weights` as EngineOptions.weights."""
        dtype = resolve_dtype(dtype)
        target_path = resolve_target(target, progress)
        draft_path = None if no_draft else resolve_any_draft(draft, target)
        draft_cfg = read_draft_config(draft_path) if draft_path is not None else None
        if draft_cfg is not None:
            refuse_dflash2(draft_cfg, draft_path)  # before the target loads: this runtime has no DFlash2 modules
        if block_size is not None and block_size > 1 and draft_cfg is None:
            raise DFlashError(
                f"--block-size {block_size} needs a draft, but target '{target}' has no default draft; pass --draft or use --block-size 1."
            )
        block = validate_block_size(block_size, draft_cfg)
        tm = TargetModel.load(target_path, DTYPES[dtype], weights=weights)
        dm = None
        if draft_cfg is not None and block > 1:
            validate_pair(
                draft_cfg,
                hidden_size=tm.hidden_size,
                num_layers=tm.num_layers,
                vocab_rows=tm.vocab_rows,
                rope_parameters=tm.rope_parameters,
            )
            dm = load_draft(draft_path, DTYPES[dtype])
            dm.pack(int8=int8_draft)
            if draft_vocab:
                dm.use_vocab(read_draft_vocab(draft_path, tm.lm_head.out_features), tm.lm_head)
            if draft_ngram:
                dm.ngram = read_draft_ngram(draft_path, tm.lm_head.out_features)
                if dm.ngram is not None:
                    dm.ngram.use_vocab(dm.vocab_token_ids)
            tm.set_taps(draft_cfg.target_layer_ids)
        return cls(tm, dm, block, speculation, held_out_tau(draft_path) if dm is not None else None, lookup)

    @classmethod
    def from_options(cls, opts: EngineOptions, base: Path, progress=print) -> DFlashEngine:
        """The engine a build's options describe (paths relative to `base`): what the Triton `dflash` model and a
        Dynamo worker serve, so both load the same engine from the same file."""
        return cls.load(
            str(base / opts.target_dir),
            str(base / opts.draft_dir) if opts.draft_dir else None,
            no_draft=not opts.draft_dir,
            dtype=opts.dtype,
            block_size=opts.block_size,
            speculation=opts.speculation,
            lookup=opts.lookup,
            int8_draft=opts.int8_draft,
            weights=opts.weights,
            progress=progress,
        )

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat, self.target.max_positions)

    def calibrate(self, batch: Batch | None = None) -> None:
        """Measure step costs for the policy, once per engine and batch size, before `batch` (default: one of a
        single slot) admits requests: forwards of every size the adaptive policy prices, and whole steps at every
        draft length for the draft length by batch size (plan.py) that `planned` follows and `adaptive` takes as its
        off switch (which one row never needs: there the plan always drafts)."""
        rows = batch.slots if batch is not None else 1
        forwards = self.policy.adaptive and rows > self._calibrated_rows
        steps = (self.policy.planned or (self.policy.adaptive and rows > 1)) and rows > self._measured_rows
        if forwards or steps:
            batch = batch or Batch(self.target, self.draft, self.block_size, policy=self.policy, lookup=self.lookup)
        if forwards:
            batch.calibrate(rows)
            self._calibrated_rows = rows
        if steps:
            batch.measure_steps()
            self._measured_rows = rows

    def scheduler(
        self,
        max_batch_size: int,
        slot_tokens: int,
        on_step=None,
        log=print,
        prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
        cache_listener: CacheListener | None = None,
    ) -> Scheduler:
        """The in-flight batching loop over this engine (one per server); `prefix_cache_tokens`: how many prompt tokens'
        K/V and features it keeps for later prompts that start the same way (prefix_cache.py), `cache_listener` what
        hears of them."""
        batch = Batch(
            self.target,
            self.draft,
            self.block_size,
            slots=max_batch_size,
            policy=self.policy,
            lookup=self.lookup,
            threads=server_threads(),
            prefix=self.prefix,
            cache_tokens=prefix_cache_tokens,
            cache_listener=cache_listener,
        )
        return Scheduler(batch, slot_tokens, on_step, log, calibrate=lambda: self.calibrate(batch))

    def stream(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        block_size: int | None = None,
        stop_strings: tuple[str, ...] = (),
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stats: GenerationStats | None = None,
        scheduler: Scheduler | None = None,
        poll=None,
    ) -> Iterator[tuple[list[int], str]]:
        """Yield (new token ids, new text) per step; `stats` is filled in as it goes.

        Alone (the CLI) the request gets its own batch of one; with a `scheduler` it joins the server's running batch,
        and `poll()` returning True (a client that left) cancels it.
        """
        if max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
        stops = frozenset(stop_token_ids) | (frozenset() if ignore_eos else self.eos_token_ids)
        stats = stats if stats is not None else GenerationStats()
        detok = IncrementalDetokenizer(self.tokenizer, stop_strings)
        handle = None
        if scheduler is not None:  # the engine thread fills its own statistics; each event brings a copy of them
            handle = scheduler.submit(Request(prompt_ids, max_new_tokens, sampling, stops, min_tokens))
            steps = _with_stats(handle.tokens(poll), stats)
        else:
            block = (
                self.block_size
                if block_size is None
                else validate_block_size(block_size, self.draft.config if self.draft else None)
            )
            if block == self.block_size:
                self.calibrate()
            policy = self.policy if block == self.block_size else None
            steps = speculative_stream(
                self.target,
                self.draft if block > 1 else None,
                prompt_ids,
                max_new_tokens,
                block,
                sampling,
                stops,
                stats,
                min_tokens,
                policy,
                self.lookup,
                self.prefix,
            )
        try:
            for ids in steps:
                delta = detok.push(ids, final=bool(stats.finish_reason))
                if detok.stopped:
                    stats.finish_reason = "stop"
                    yield ids, delta
                    return
                yield ids, delta
            if handle is not None and not stats.finish_reason:  # ended without a reason: the client cancelled
                stats.finish_reason = "cancelled"
        finally:
            if handle is not None:
                handle.cancel()
            steps.close()

    def generate(self, prompt: str, *, chat: bool = True, **kwargs) -> GenerationResult:
        stats = GenerationStats()
        ids, text = [], []
        for new_ids, delta in self.stream(self.encode(prompt, chat), stats=stats, **kwargs):
            ids.extend(new_ids)
            text.append(delta)
        return GenerationResult("".join(text), ids, stats)
