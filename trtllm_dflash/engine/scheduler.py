"""In-flight batching: one engine thread runs the batched step; request threads submit and read their own queue.

Between steps the loop retires finished and cancelled rows at once, continues or admits one prefill (arrival
order, up to PREFILL_TOKENS prompt tokens in the prompt's canonical chunks), and runs one draft + verify step for
every running row. The KV cache is static: `slots`
rows of `slot_tokens` positions each, so a request either fits a free slot or can never run, and is told so
when it arrives.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

from trtllm_dflash.engine.batch import Batch
from trtllm_dflash.engine.prefix_cache import BLOCK
from trtllm_dflash.engine.request import Request
from trtllm_dflash.engine.step import StepRecord
from trtllm_dflash.errors import DFlashError

DONE = object()
PREFILL_TOKENS = (
    512  # prompt tokens computed between two steps: a long prompt holds the running rows ~0.5 s at most on a
)
# 2-core CPU, and one of a few thousand tokens waits a few steps, not one step per 64-token chunk


def _gauge(help: str):
    return field(default=0, metadata={"prometheus": "gauge", "help": help})


def _counter(help: str):
    return field(default=0, metadata={"prometheus": "counter", "help": help})


@dataclass
class EngineMetrics:
    """What a Prometheus scrape shows: gauges of the last step and running totals. Each published field carries its
    kind and help text (`published`), so the Triton model's metric families are these fields, not a copy of them."""

    running: int = _gauge("Requests in the running batch")
    queued: int = _gauge("Requests waiting for a slot")
    batch_size: int = _gauge("Rows in the last engine step")
    block_length: float = _gauge(
        "Tokens verified per row in the last step (the block lengths the policy chose, averaged over rows)"
    )
    tokens_last_step: int = _gauge("Tokens committed by the last engine step, all rows")
    steps: int = _counter("Engine steps (one draft + one verify forward for all rows)")
    prompt_tokens: int = _counter("Prompt tokens prefilled")
    cached_prompt_tokens: int = _counter("Prompt tokens whose K/V came from the prefix cache instead of a forward")
    generated_tokens: int = _counter("Tokens generated")
    drafted_tokens: int = _counter("Draft tokens proposed for verification")
    accepted_tokens: int = _counter("Draft tokens accepted")
    lookup_steps: int = _counter("Request-steps that verified prompt-lookup guesses instead of the draft's")
    lookup_accepted_tokens: int = _counter("Prompt-lookup guesses accepted (also counted in accepted_tokens)")
    requests_finished: int = _counter("Requests completed")
    requests_failed: int = _counter("Requests that ended in an error")
    row_steps: int = 0  # sum over steps of the rows in them
    block_lengths: dict[int, int] = field(default_factory=dict)  # block length chosen -> row-steps
    ACCEPTANCE_HELP: ClassVar[str] = "Committed tokens per row per step since start (1.0 = no speculation)"

    @property
    def acceptance_length(self) -> float:
        """Committed tokens per row-step over the server's life (1.0 = no speculation)."""
        return (self.accepted_tokens + self.row_steps) / self.row_steps if self.row_steps else 0.0

    @classmethod
    def published(cls) -> dict[str, tuple[str, str]]:
        """name -> (gauge | counter, help) of every value a scrape shows (block_lengths: one counter per length)."""
        out = {
            f.name: (f.metadata["prometheus"], f.metadata["help"]) for f in fields(cls) if "prometheus" in f.metadata
        }
        return out | {"acceptance_length": ("gauge", cls.ACCEPTANCE_HELP)}

    def add_step(self, step: StepRecord) -> None:
        self.steps += 1
        self.row_steps += step.rows
        self.batch_size, self.block_length = step.rows, sum(step.ks) / step.rows
        for k in step.ks:
            self.block_lengths[k] = self.block_lengths.get(k, 0) + 1
        self.drafted_tokens += step.drafted_tokens
        self.accepted_tokens += step.accepted_tokens
        self.lookup_steps += step.lookup_steps
        self.lookup_accepted_tokens += step.lookup_accepted_tokens
        self.tokens_last_step = step.tokens
        self.generated_tokens += step.tokens


class Handle:
    """A submitted request as its own thread sees it: events arrive on `events`, `cancel()` retires it at the next step.

    `events` is anything with a thread-safe `put`: a queue.Queue (default) that a request thread reads, or a bridge
    into an event loop (an asyncio server's request reads the same events without a thread of its own)."""

    def __init__(self, req: Request, events=None):
        self.req, self.events, self.cancelled = req, queue.Queue() if events is None else events, False

    def cancel(self) -> None:
        self.cancelled = True

    def put(self, tokens: list[int]) -> None:
        """From the engine thread: new tokens with a copy of the statistics as of them, so the reader's view is consistent."""
        s = self.req.stats
        self.events.put(
            (
                tokens,
                replace(s, accepted_per_position=list(s.accepted_per_position), block_lengths=dict(s.block_lengths)),
            )
        )

    def tokens(self, poll=None):
        """Yield (token list, statistics as of it) until the request ends; raises its error. `poll()` -> True cancels."""
        while True:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                if poll is not None and poll():
                    self.cancel()
                continue
            if event is DONE:
                return
            if isinstance(event, BaseException):
                raise event
            yield event


class Scheduler:
    def __init__(self, batch: Batch, slot_tokens: int, on_step=None, log=print, calibrate=None):
        """`calibrate()`: measures the batch's costs (DFlashEngine.calibrate); it runs on the engine thread before
        the loop starts, and the constructor returns once it has (raising what it raised). On the engine thread
        because every torch forward must run there: a prompt's prefill is parallel (threads.widened), an OpenMP team
        started from a second thread keeps its worker, and beside it the engine's prefills took about 1.7x as long
        (likely libgomp, managing more threads than CPUs, shortening its waiting threads' spin;
        docs/performance.md#threads-one-team)."""
        self.batch, self.slot_tokens, self.on_step, self.log = batch, slot_tokens, on_step, log
        self.metrics = EngineMetrics()
        self.waiting: deque[Handle] = deque()
        self.running: dict[Request, Handle] = {}
        self.cv = threading.Condition()
        self.stopping = False
        self._calibrated, self._error = threading.Event(), None
        self.thread = threading.Thread(target=self._loop, args=(calibrate,), name="dflash-engine", daemon=True)
        self.thread.start()
        self._calibrated.wait()
        if self._error is not None:
            self.thread.join()
            raise self._error

    def submit(self, req: Request, events=None) -> Handle:
        """Queue `req`; what it commits arrives on the handle's `events` (Handle), then DONE or an error."""
        need = len(req.prompt_ids) + req.max_new_tokens + self.batch.block_size
        if need > self.slot_tokens:
            raise DFlashError(
                f"This request needs {need} KV-cache positions (prompt {len(req.prompt_ids)} + max_tokens "
                f"{req.max_new_tokens} + block {self.batch.block_size}) but a slot holds {self.slot_tokens}; "
                "lower max_tokens or shorten the prompt."
            )
        handle = Handle(req, events)
        with self.cv:
            self.waiting.append(handle)
            self.metrics.queued = len(self.waiting)
            self.cv.notify()
        return handle

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        self.thread.join(timeout=30)

    def _finish(self, handle: Handle, error: BaseException | None = None) -> None:
        req = handle.req
        if req in self.batch.rows:
            self.batch.remove(req)
        self.running.pop(req, None)
        if error is None:
            self.metrics.requests_finished += 1
        else:
            self.metrics.requests_failed += 1
        handle.events.put(DONE if error is None else error)

    def _admit(self) -> None:
        """Continue the prefill in progress, else start the next waiting request if a slot is free."""
        batch = self.batch
        prefilling = [r for r in batch.rows if r.prefilled < len(r.prompt_ids)]
        if prefilling:
            req = prefilling[0]
        else:
            with self.cv:
                while self.waiting and self.waiting[0].cancelled:
                    self.waiting.popleft().events.put(DONE)
                if not self.waiting or len(batch.rows) >= batch.slots:
                    self.metrics.queued = len(self.waiting)
                    return
                handle = self.waiting.popleft()
                self.metrics.queued = len(self.waiting)
            req = handle.req
            self.running[req] = handle
            self.metrics.prompt_tokens += len(req.prompt_ids)
        handle = self.running[req]
        try:
            fresh, start = req.prefilled == 0, req.prefilled
            first = batch.add(req)
            if fresh:
                self.metrics.cached_prompt_tokens += req.stats.cached_tokens
                start = req.stats.cached_tokens  # copied chunks are not computed
            while not first and req.prefilled - start + BLOCK <= PREFILL_TOKENS:  # the next chunk still fits
                first = batch.add(req)
        except Exception as e:  # this request alone fails (a bug or an impossible input); the rest keep running
            self._finish(
                handle, e if isinstance(e, DFlashError) else DFlashError(f"internal error: {type(e).__name__}: {e}")
            )
            return
        if first:
            self.metrics.generated_tokens += len(first)
            handle.put(first)

    def _loop(self, calibrate) -> None:
        try:
            if calibrate is not None:
                calibrate()
        except BaseException as e:  # the constructor raises it
            self._error = e
            return
        finally:
            self._calibrated.set()
        batch = self.batch
        while True:
            with self.cv:
                while not self.stopping and not self.waiting and not batch.rows:
                    self.cv.wait()
                if self.stopping:
                    break
            for req in [r for r in batch.rows if r.stats.finish_reason or self.running[r].cancelled]:
                self._finish(self.running[req])
            self._admit()
            for req in [r for r in batch.rows if r.stats.finish_reason]:  # done at its first token
                self._finish(self.running[req])
            rows = batch.ready
            if not rows:
                continue
            try:
                out = batch.step()
            except (
                Exception
            ) as e:  # a failed forward leaves every row of it undefined: they fail, the server keeps serving
                error = DFlashError(f"internal error: {type(e).__name__}: {e}")
                for req in rows:
                    self._finish(self.running[req], error)
                continue
            m = self.metrics
            m.add_step(batch.last_step)
            for req, tokens in out.items():
                if tokens:
                    self.running[req].put(tokens)
            for req in [r for r in rows if r.stats.finish_reason]:
                self._finish(self.running[req])
            m.running = len(batch.rows)
            if self.on_step is not None:
                try:
                    self.on_step(m)
                except Exception as e:  # metrics are not worth a stopped engine
                    self.log(f"dflash: publishing metrics failed: {type(e).__name__}: {e}")
        for handle in list(self.running.values()) + list(self.waiting):
            handle.events.put(DFlashError("The server is shutting down."))
