"""One request on TensorRT-LLM's LLM API as the engine model's steps: (new token ids, new text) per iteration.

The text comes from our IncrementalDetokenizer, not from TensorRT-LLM's detokenizer, so stop strings and text
deltas behave exactly as on the embedded backend; a stop string aborts the request, once.

Draft counts come from the engine where it has them: `SamplingParams(return_perf_metrics=True)` fills
`outputs[0].request_perf_metrics.speculative_decoding` with the drafts actually verified per step, which follows
`draft_len_schedule`, `max_concurrency` and a request's tail (tensorrt_llm/_torch/pyexecutor/py_executor.py
`_accumulate_spec_dec_stats`, PR #17082). Before that PR the PyTorch flow leaves those counters at zero; then the
counts are inferred from `decoding_iter` (the context phase plus one iteration per verify) as if every step
drafted `max_draft_len`, and the response says so (`draft_counts_estimated`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping

from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.serving.protocol import EngineRequest
from trtllm_dflash.text import IncrementalDetokenizer

# tensorrt_llm/executor/result.py CompletionOutput.finish_reason: Literal['stop', 'length', 'timeout', 'cancelled']
FINISH_REASONS = ("stop", "length", "timeout", "cancelled")

# The MPI job variables that `mpirun -n 1 tritonserver` (Triton's launch_triton_server.py) leaves set. TensorRT-LLM
# must start MPI afresh in the python backend's process to spawn its own workers, so they are cleared before it is
# imported; configuration (OMPI_MCA_*, PMIX_MCA_*) stays. The list is upstream's: NVIDIA/TensorRT-LLM
# triton_backend/all_models/llmapi/tensorrt_llm/1/model.py at 044a90d2.
MPI_JOB_VARIABLES = frozenset(
    {
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_NODE_RANK",
        "OMPI_UNIVERSE_SIZE",
        "OMPI_FIRST_RANKS",
        "OMPI_APP_CTX_NUM_PROCS",
        "PMIX_RANK",
        "PMIX_NAMESPACE",
        "PMIX_SERVER_URI",
        "PMIX_SERVER_URI2",
        "PMIX_SERVER_URI21",
        "PMIX_SERVER_URI3",
        "PMIX_SERVER_TMPDIR",
        "PMIX_SYSTEM_TMPDIR",
        "PMIX_SECURITY_MODE",
        "PMIX_GDS_MODULE",
        "PMIX_BFROPS_MODULE",
        "PMIX_PTL_MODULE",
        "PMIX_VERSION",
        "PMIX_HOSTNAME",
        "PMI_RANK",
        "PMI_SIZE",
        "PMI_FD",
        "PMI_SPAWNED",
        "PMI_APPNUM",
    }
)
MPI_JOB_PREFIXES = ("OMPI_MCA_orte_", "ORTE_")


def clear_mpi_job_env(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Remove the MPI job variables a launcher left; returns their names."""
    names = sorted(k for k in environ if k in MPI_JOB_VARIABLES or k.startswith(MPI_JOB_PREFIXES))
    for name in names:
        del environ[name]
    return names


def sampling_kwargs(job: EngineRequest) -> dict:
    """TensorRT-LLM SamplingParams fields (tensorrt_llm/sampling_params.py): top_k 1 is greedy in every release."""
    s = job.sampling
    kw = {"max_tokens": job.max_tokens, "detokenize": False, "return_perf_metrics": True}
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


def count_drafts(stats: GenerationStats, decoding_iter: int, perf_metrics, max_draft_len: int) -> None:
    """Fill stats.steps, drafted_tokens and accepted_tokens after `stats.num_tokens` tokens.

    Invariant: the engine's counts are used whenever they can be true. All-zero counts while some step committed
    more than one token cannot be (drafts were accepted), so they mark an engine that does not count."""
    stats.steps = max(int(decoding_iter) - 1, 0)
    spec = getattr(perf_metrics, "speculative_decoding", None)
    drafted = int(getattr(spec, "total_draft_tokens", 0) or 0)
    accepted = int(getattr(spec, "total_accepted_draft_tokens", 0) or 0)
    inferred_accepted = max(stats.num_tokens - 1 - stats.steps, 0)
    if spec is not None and (drafted or not inferred_accepted):
        stats.drafted_tokens, stats.accepted_tokens, stats.draft_counts_estimated = drafted, accepted, False
    else:
        stats.drafted_tokens, stats.accepted_tokens = stats.steps * max_draft_len, inferred_accepted
        stats.draft_counts_estimated = True


def llm_steps(
    llm, sampling_params_cls, job: EngineRequest, stats: GenerationStats, tokenizer, max_draft_len: int
) -> Iterator[tuple[list[int], str]]:
    result = llm.generate_async(job.prompt_ids, sampling_params_cls(**sampling_kwargs(job)), streaming=True)
    detok = IncrementalDetokenizer(tokenizer, job.stop_strings)
    stats.prompt_tokens = len(job.prompt_ids)
    aborted = False
    try:
        for out in result:
            completion = out.outputs[0]
            new = list(completion.token_ids_diff)
            stats.num_tokens = len(completion.token_ids)
            count_drafts(stats, out.decoding_iter, getattr(completion, "request_perf_metrics", None), max_draft_len)
            delta = detok.push(new, final=out.finished)
            if detok.stopped:
                stats.finish_reason = "stop"
                aborted = True
                result.abort()
            elif out.finished:
                reason = completion.finish_reason
                stats.finish_reason = reason if reason in FINISH_REASONS else "stop"
            yield new, delta
            if stats.finish_reason:
                return
    finally:
        if not aborted and not result.finished:  # the client left, or the server is stopping
            result.abort()
