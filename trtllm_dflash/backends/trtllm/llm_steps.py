"""One request on TensorRT-LLM's LLM API as the engine model's steps: (new token ids, new text) per iteration.

The text comes from our IncrementalDetokenizer, not from TensorRT-LLM's detokenizer, so stop strings and text
deltas behave exactly as on the embedded backend; a stop string aborts the request. DFlash statistics follow from
the iteration count: TensorRT-LLM's `decoding_iter` counts the context phase (which yields the first token) and
one iteration per verify of `max_draft_len` drafted tokens.
"""

from __future__ import annotations

from typing import Iterator

from ...generate import GenerationStats
from ...protocol import EngineRequest
from ...runtime import IncrementalDetokenizer


def sampling_kwargs(job: EngineRequest) -> dict:
    """TensorRT-LLM SamplingParams fields (tensorrt_llm/sampling_params.py): top_k 1 is greedy in every release."""
    s = job.sampling
    kw = {"max_tokens": job.max_tokens, "detokenize": False}
    if s.greedy:
        kw["top_k"] = 1
    else:
        kw.update(temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p if s.top_p < 1 else None)
    if s.seed is not None:
        kw["seed"] = s.seed
    if job.stop_token_ids:
        kw["stop_token_ids"] = list(job.stop_token_ids)
    if job.min_tokens:
        kw["min_tokens"] = job.min_tokens
    return kw


def llm_steps(llm, sampling_params_cls, job: EngineRequest, stats: GenerationStats, tokenizer, max_draft_len: int
              ) -> Iterator[tuple[list[int], str]]:
    result = llm.generate_async(job.prompt_ids, sampling_params_cls(**sampling_kwargs(job)), streaming=True)
    detok = IncrementalDetokenizer(tokenizer, job.stop_strings)
    stats.prompt_tokens = len(job.prompt_ids)
    try:
        for out in result:
            completion = out.outputs[0]
            new = list(completion.token_ids_diff)
            stats.num_tokens = len(completion.token_ids)
            stats.steps = max(int(out.decoding_iter) - 1, 0)
            stats.drafted_tokens = stats.steps * max_draft_len
            stats.accepted_tokens = max(stats.num_tokens - 1 - stats.steps, 0)
            delta = detok.push(new, final=out.finished)
            if detok.stopped:
                stats.finish_reason = "stop"
                result.abort()
            elif out.finished:
                stats.finish_reason = "stop" if completion.finish_reason == "stop" else "length"
            yield new, delta
            if stats.finish_reason:
                return
    finally:
        if not result.finished:
            result.abort()
