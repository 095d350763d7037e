"""The embedded DFlash engine as an NVIDIA Dynamo worker: tokens in, tokens out, behind Dynamo's frontend and KV router.

Dynamo's backend API (`dynamo.common.backend.LLMEngine`, ai-dynamo 1.6.1) owns registration, the request plane,
cancellation and shutdown; this module owns the engine. Requests join the build's in-flight batch (one
`Scheduler`, as the Triton `dflash` model runs it) and stream each step's committed tokens; the frontend renders the
chat template and detokenizes (tests/serving/test_dynamo.py checks it renders what `text.encode_prompt` does, token
for token) and applies stop strings.

The prefix cache is published as KV events (`RouterBlocks`), so the KV router sends a conversation's next turn to
the worker that holds its prompt's K/V and, with it, the draft's context features: a cached prefix keeps its
acceptance (engines that rebuild the draft's context on a hit lose it: vLLM #47930, z-lab #165).

Run by `trtdflash serve BUILD --dynamo` (serving/fleet.py), or by hand:
`python -m trtllm_dflash.serving.dynamo_worker --build DIR --discovery-backend file --event-plane zmq`.
Importable only where ai-dynamo is installed (the `dynamo` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import threading
from array import array
from collections.abc import Sequence
from pathlib import Path

from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.metrics import register_engine_registry
from dynamo.common.backend.publisher import PushSource
from dynamo.common.backend.run import run
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument

from trtllm_dflash.config import ENGINE_FILE, EngineOptions, SamplingParams
from trtllm_dflash.deploy import read_build
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.serving.openai_server import model_id

log = logging.getLogger(__name__)

ROUTER_BLOCK = 16  # tokens per block as the KV router counts them (vLLM's default): finer than the cache's chunks,
# so a prompt's cached prefix is matched to within 16 tokens
COMPONENT = "dflash"  # the worker's Dynamo component; its endpoint is `generate`


def block_hashes(tokens: Sequence[int], blocks: int) -> list[int]:
    """Signed 64-bit ids of the first `blocks` router blocks of `tokens`, each chained over every block before it
    (as the cache's chunk keys are): equal ids, equal prefixes."""
    out, key = [], b""
    for i in range(blocks):
        key = hashlib.blake2b(
            key + array("q", tokens[i * ROUTER_BLOCK : (i + 1) * ROUTER_BLOCK]).tobytes(), digest_size=8
        ).digest()
        out.append(int.from_bytes(key, "little", signed=True))
    return out


class RouterBlocks:
    """The prefix cache as the KV router sees it: a router block is held while any cache entry covers it.

    An entry holding positions [start, end) of a prompt completes the router blocks that end in (start, end]: with
    the entries before it in the prompt (the cache keeps a prompt's chunks in order) they hold the whole block.
    Several entries can complete one block (prompts that share it and then differ), so each block counts its
    entries; it is published stored at its first and removed after its last. Runs on the engine thread; the
    publisher only enqueues."""

    def __init__(self):
        self.publisher = None  # Dynamo's KvEventPublisher, once the worker hands it over
        self.entries: dict[bytes, list[int]] = {}  # cache key -> the router blocks it completes
        self.count: dict[int, int] = {}  # router block -> entries completing it

    def stored(self, key: bytes, prompt: Sequence[int], start: int, end: int) -> None:
        first, end = start // ROUTER_BLOCK, end // ROUTER_BLOCK  # the router blocks that end in (start, end]
        if end <= first:
            self.entries[key] = []
            return
        hashes = block_hashes(prompt, end)
        self.entries[key] = hashes[first:]
        new = [i for i in range(first, end) if self.count.get(hashes[i], 0) == 0]
        for h in hashes[first:]:
            self.count[h] = self.count.get(h, 0) + 1
        for run_start, run_end in _runs(new):  # one stored event per run of new blocks, linked to its parent
            self._publish(
                "publish_stored",
                token_ids=list(prompt[run_start * ROUTER_BLOCK : run_end * ROUTER_BLOCK]),
                num_block_tokens=[ROUTER_BLOCK] * (run_end - run_start),
                block_hashes=hashes[run_start:run_end],
                parent_hash=hashes[run_start - 1] if run_start else None,
            )

    def removed(self, key: bytes) -> None:
        gone = []
        for h in self.entries.pop(key, []):
            self.count[h] -= 1
            if not self.count[h]:
                del self.count[h]
                gone.append(h)
        if gone:
            self._publish("publish_removed", block_hashes=gone)

    def _publish(self, method: str, **event) -> None:
        if self.publisher is None:
            return
        try:
            getattr(self.publisher, method)(**event)
        except Exception as e:  # a lost event costs a worse route, never a wrong answer
            log.warning("dflash: KV event dropped: %s: %s", type(e).__name__, e)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """[2, 3, 4, 7] -> [(2, 5), (7, 8)]: maximal runs of consecutive indices as half-open ranges."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class _LoopEvents:
    """A Handle's events, put from the engine thread into an asyncio queue of the worker's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the worker's loop has closed (shutting down): nobody reads this request any more
            pass


def _number(options: dict, name: str, default, kind=float):
    value = options.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number, got {value!r}.")
    return kind(value)


UNSUPPORTED = {  # sampling options whose only value here is their default (None always means the default)
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "use_beam_search": False,
    "guided_decoding": None,
}


def sampling_of(options: dict) -> SamplingParams:
    """Dynamo's sampling_options -> ours; temperature 1 unless given (OpenAI's default, as our OpenAI frontend)."""
    for name, default in UNSUPPORTED.items():
        value = options.get(name)
        if value is not None and value != default:
            raise InvalidArgument(f"{name}={value!r} is not supported by the DFlash runtime; leave it out.")
    top_k = _number(options, "top_k", 0, int)
    try:
        return SamplingParams(
            _number(options, "temperature", 1.0),
            _number(options, "top_p", 1.0),
            max(top_k, 0),  # -1 is "off" in Dynamo's and vLLM's convention, 0 in ours
            _number(options, "seed", None, int),
        )
    except DFlashError as e:
        raise InvalidArgument(str(e)) from None


class DFlashWorker(LLMEngine):
    """One build's engine behind Dynamo's backend API. Invariant: every torch forward runs on the scheduler's engine
    thread; `generate` only submits and reads events, so the event loop never waits on a forward."""

    def __init__(self, build_dir: Path, max_batch_size: int | None = None):
        self.build_dir = Path(build_dir).expanduser().resolve()
        self.manifest = read_build(self.build_dir)
        if self.manifest["serve"].get("backend") != "torch":
            raise DFlashError(
                f"{self.build_dir} is a TensorRT-LLM deployment; on GPUs Dynamo serves it with `python -m dynamo.trtllm` "
                "(its dynamo/launch.sh), and only an embedded (--backend torch) build runs as this CPU worker."
            )
        resolved = self.manifest["resolved"]
        self.max_seq_len = int(resolved["max_seq_len"])
        self.max_batch_size = int(max_batch_size or resolved["max_batch_size"])
        self.model_dir = self.build_dir / self.manifest["serve"]["model_repository"] / "dflash"  # engine paths' base
        self.opts = EngineOptions.from_json(
            (self.model_dir / ENGINE_FILE).read_text(), str(self.model_dir / ENGINE_FILE)
        )
        self.target_dir = (
            self.model_dir / self.opts.target_dir
        ).resolve()  # the frontend reads its tokenizer, template
        self.engine = self.scheduler = None
        self.blocks = RouterBlocks()
        self.handles: dict[str, object] = {}  # Dynamo request id -> Handle, for abort()

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[DFlashWorker, WorkerConfig]:
        p = argparse.ArgumentParser(description="A trtllm-dflash build as an NVIDIA Dynamo worker.")
        p.add_argument("--build", required=True, help="A `trtdflash build` output folder (embedded backend).")
        p.add_argument("--namespace", default="dynamo")
        p.add_argument("--max-batch-size", type=int, default=None, help="Default: the build's.")
        p.add_argument("--discovery-backend", default="etcd", choices=["etcd", "file", "kubernetes", "mem"])
        p.add_argument("--request-plane", default="tcp", choices=["tcp", "nats"])
        p.add_argument("--event-plane", default=None, choices=["zmq", "nats"])
        args = p.parse_args(argv)
        worker = cls(Path(args.build), args.max_batch_size)
        config = WorkerConfig(
            namespace=args.namespace,
            component=COMPONENT,
            endpoint="generate",
            model_name=str(worker.target_dir),
            served_model_name=model_id(worker.manifest),
            discovery_backend=args.discovery_backend,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
        )
        return worker, config

    async def start(self, worker_id: int) -> EngineConfig:
        from trtllm_dflash.engine.runtime import DFlashEngine

        opts = self.opts
        self.engine = await asyncio.to_thread(DFlashEngine.from_options, opts, self.model_dir, log.info)
        slot = self.max_seq_len + self.engine.block_size
        self.scheduler = await asyncio.to_thread(
            self.engine.scheduler,
            self.max_batch_size,
            slot,
            log=log.error,
            prefix_cache_tokens=opts.prefix_cache_tokens,
            cache_listener=self.blocks,
        )
        log.info(
            "dflash worker %s ready: block size %d, draft %s, up to %d requests",
            worker_id,
            self.engine.block_size,
            self.engine.draft_weights or "no",
            self.max_batch_size,
        )
        return EngineConfig(
            model=str(self.target_dir),
            served_model_name=model_id(self.manifest),
            llm=LlmRegistration(
                context_length=self.max_seq_len,
                kv_cache_block_size=ROUTER_BLOCK,
                total_kv_blocks=self.max_batch_size * slot // ROUTER_BLOCK,
                max_num_seqs=self.max_batch_size,
            ),
        )

    async def kv_event_sources(self):
        return [PushSource(on_ready=self._publisher_ready, dp_rank=0)]

    def _publisher_ready(self, publisher) -> None:
        self.blocks.publisher = publisher

    async def register_prometheus(self, metrics) -> None:
        """The engine's metrics (the Triton model's `dflash_*` families) on the worker's /metrics."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        registry.register(_EngineCollector(lambda: None if self.scheduler is None else self.scheduler.metrics))
        register_engine_registry(metrics, registry)

    def _request(self, request: dict):
        from trtllm_dflash.engine.request import Request

        prompt = request.get("token_ids") or []
        if not prompt:
            raise InvalidArgument("The prompt is empty.")
        stop = request.get("stop_conditions") or {}
        room = self.max_seq_len - len(prompt)
        if room < 1:
            raise InvalidArgument(f"The prompt is {len(prompt)} tokens, but the context window is {self.max_seq_len}.")
        max_tokens = _number(stop, "max_tokens", room, int)
        min_tokens = _number(stop, "min_tokens", 0, int)
        if max_tokens < 1 or min_tokens < 0:
            raise InvalidArgument(f"max_tokens must be >= 1 and min_tokens >= 0, got {max_tokens} and {min_tokens}.")
        stops = frozenset(stop.get("stop_token_ids_hidden") or ())
        if not stop.get("ignore_eos"):
            stops |= self.engine.eos_token_ids
        sampling = sampling_of(request.get("sampling_options") or {})
        return Request(prompt, max_tokens, sampling, stops, min_tokens)

    async def generate(self, request, context):
        from trtllm_dflash.engine.scheduler import DONE

        req = self._request(request)
        events = _LoopEvents(asyncio.get_running_loop())
        try:
            handle = self.scheduler.submit(req, events)
        except DFlashError as e:
            raise InvalidArgument(str(e)) from None
        self.handles[context.id()] = handle
        stats = req.stats
        try:
            while True:
                event = await events.queue.get()
                if event is DONE:
                    break
                if isinstance(event, BaseException):  # the engine's sentence: a failed step, or shutting down
                    raise EngineShutdown(str(event)) if self.scheduler is None else event
                tokens, stats = event
                chunk = {"token_ids": tokens, "index": 0}
                if stats.finish_reason:
                    yield chunk | self._final(stats)
                    return
                yield chunk
            yield {"token_ids": [], "index": 0} | self._final(stats, "cancelled")
        finally:
            handle.cancel()
            self.handles.pop(context.id(), None)

    @staticmethod
    def _final(stats, reason: str | None = None) -> dict:
        return {
            "finish_reason": reason or stats.finish_reason,  # stop | length | cancelled: Dynamo's names too
            "completion_usage": {
                "prompt_tokens": stats.prompt_tokens,
                "completion_tokens": stats.num_tokens,
                "total_tokens": stats.prompt_tokens + stats.num_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            },
        }

    async def abort(self, context) -> None:
        handle = self.handles.get(context.id())
        if handle is not None:
            handle.cancel()

    async def cleanup(self) -> None:
        self.blocks.publisher = None
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
            self.scheduler = None


class _EngineCollector:
    """prometheus_client collector over the scheduler's EngineMetrics: each published field, read at scrape time."""

    def __init__(self, metrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from trtllm_dflash.engine.scheduler import EngineMetrics

        m = self.metrics()
        if m is None:
            return
        for name, (kind, help) in EngineMetrics.published().items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(f"dflash_{name}", help, value=float(getattr(m, name)))


def main(argv: list[str] | None = None) -> None:
    threading.current_thread().name = "dflash-worker"
    run(DFlashWorker, argv)


if __name__ == "__main__":
    main()
