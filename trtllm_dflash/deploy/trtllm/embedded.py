"""Our embedded PyTorch engine behind the part of TensorRT-LLM's LLM API that the `tensorrt_llm` Triton model uses.

The TensorRT-LLM backend's Triton model is written against `tensorrt_llm.LLM`. A machine without a GPU (tests,
CI) cannot run TensorRT-LLM, so there the model loads this module instead (TRTDFLASH_LLM_ENGINE=embedded): the
repository, model.yaml plumbing, ensemble, streaming and cancellation run for real and only the engine differs.

The surface, as TensorRT-LLM 1.x defines it (tensorrt_llm/llmapi/llm.py `LLM.generate_async`,
tensorrt_llm/sampling_params.py `SamplingParams`, tensorrt_llm/executor/result.py `GenerationResult` and
`CompletionOutput`, read at NVIDIA/TensorRT-LLM main):
  LLM(model=..., speculative_config={decoding_type: DFlash, max_draft_len, speculative_model}, **llm_args)
  llm.generate_async(prompt_token_ids, SamplingParams(...), streaming=True) -> a result that is iterated
  (one item per engine iteration), with .outputs[0].token_ids / .token_ids_diff / .finish_reason /
  .request_perf_metrics.speculative_decoding (with return_perf_metrics), .finished, .decoding_iter (iterations so
  far, the context phase included), .abort(); llm.shutdown().
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

from trtllm_dflash.config import SamplingParams as OurSampling
from trtllm_dflash.config import block_size_of
from trtllm_dflash.engine.batch import speculative_stream
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine

DTYPES = {"auto": "fp32", "float32": "fp32", "bfloat16": "bf16"}  # auto: fp32 keeps greedy bit-exact on CPU


@dataclass(kw_only=True)
class SamplingParams:
    """The fields the engine model sets; TensorRT-LLM's meaning (top_k 1 or temperature 0 is greedy)."""

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    detokenize: bool = True
    return_perf_metrics: bool = False

    def ours(self) -> OurSampling:
        if self.top_k == 1 or self.temperature == 0:
            return OurSampling(0.0, seed=self.seed)
        return OurSampling(
            1.0 if self.temperature is None else self.temperature, self.top_p or 1.0, self.top_k or 0, self.seed
        )


@dataclass
class CompletionOutput:
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # 'stop' | 'length' | 'cancelled'
    request_perf_metrics: SimpleNamespace | None = None  # with return_perf_metrics: .speculative_decoding's counts
    _last_token_ids_len: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


class RequestOutput:
    """One request's result: iterating advances it one engine iteration (everything at once unless streaming)."""

    def __init__(self, llm: LLM, prompt_ids: list[int], params: SamplingParams, streaming: bool):
        self._llm, self._streaming, self._aborted = llm, streaming, False
        self._perf_metrics = params.return_perf_metrics
        self.prompt_token_ids = list(prompt_ids)
        self.outputs = [CompletionOutput()]
        self.finished = False
        self.decoding_iter = 0
        self.aborts = 0
        self._stats = GenerationStats()
        engine = llm.engine
        stops = frozenset(params.stop_token_ids or ()) | engine.eos_token_ids
        self._steps = speculative_stream(
            engine.target,
            engine.draft,
            self.prompt_token_ids,
            params.max_tokens,
            engine.block_size,
            params.ours(),
            stops,
            self._stats,
            params.min_tokens or 0,
            lookup=False,  # TensorRT-LLM's DFlash mode drafts every block with the draft
            prefix=engine.prefix,
        )

    def abort(self) -> None:
        """As upstream's, unguarded: each call sends another cancellation to the executor, so callers abort once."""
        self._aborted = True
        self.aborts += 1

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        if self.finished:
            raise StopIteration
        out = self.outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        while not self.finished:
            with self._llm.step_lock:  # one model copy: requests interleave step by step
                ids = None if self._aborted else next(self._steps, None)
            if ids is None:
                self._steps.close()
                self.finished = True
                out.finish_reason = (
                    "cancelled" if self._aborted else ("stop" if self._stats.finish_reason == "stop" else "length")
                )
            else:
                out.token_ids.extend(ids)
                self.decoding_iter = self._stats.steps + 1
            if self._perf_metrics:  # the drafts each step verified, as TensorRT-LLM counts them since PR #17082
                spec = SimpleNamespace(
                    total_draft_tokens=self._stats.drafted_tokens,
                    total_accepted_draft_tokens=self._stats.accepted_tokens,
                )
                out.request_perf_metrics = SimpleNamespace(speculative_decoding=spec)
            if self._streaming:
                break
        return self


class LLM:
    """`tensorrt_llm.LLM` on the embedded runtime: one model copy on CPU; parallelism, KV-cache and CUDA-graph
    options have no meaning here and are recorded in `ignored_options`."""

    def __init__(self, model: str, *, speculative_config: dict | None = None, dtype: str = "auto", **llm_args):
        spec = speculative_config or {}
        if spec and spec.get("decoding_type") != "DFlash":
            raise ValueError(
                f"the embedded engine runs DFlash speculative decoding only, not {spec.get('decoding_type')!r}"
            )
        draft = spec.get("speculative_model") or spec.get("speculative_model_dir")
        block = block_size_of(int(spec["max_draft_len"])) if draft else 1
        self.engine = DFlashEngine.load(
            model, draft, no_draft=draft is None, dtype=DTYPES[dtype], block_size=block, progress=lambda m: None
        )
        self.step_lock = threading.Lock()
        self.ignored_options = sorted(llm_args)

    def generate_async(
        self, inputs: list[int], sampling_params: SamplingParams | None = None, streaming: bool = False
    ) -> RequestOutput:
        return RequestOutput(self, inputs, sampling_params or SamplingParams(), streaming)

    def shutdown(self) -> None:
        self.engine = None
