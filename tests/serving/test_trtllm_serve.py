"""The TensorRT-LLM backend's repository on the REAL tritonserver, on CPU: the `tensorrt_llm` Triton model runs the
same code it runs on a GPU host, with our embedded engine behind the `tensorrt_llm.LLM` API surface
(TRTDFLASH_LLM_ENGINE=embedded). Only the engine swap is not exercised here.
"""

import json
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import tritonclient.grpc as grpcclient

from trtllm_dflash.clients.client import CompletionRequest, complete
from trtllm_dflash.deploy.trtllm.llm_steps import clear_mpi_job_env, count_drafts, llm_steps
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.serving.serve import ServerConfig, TritonServer

pytestmark = pytest.mark.slow  # real servers (see pyproject.toml's markers)

PROMPT = "What is 7 times 8?"
MAX_TOKENS = 24
BLOCK = 4


@pytest.fixture(scope="module")
def build_dir(trtllm_deployment):
    return trtllm_deployment


@pytest.fixture(scope="module")
def server(build_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRTDFLASH_LLM_ENGINE", "embedded")
        with TritonServer(ServerConfig(build_dir, grpc_port=0, http_port=0, metrics_port=0)) as s:
            yield s


@pytest.fixture(scope="module")
def reference(target_dir):
    """The embedded runtime directly, with what model.yaml asks for: bf16 (the checkpoint is fp32), block 4 every step,
    the draft's guesses only (TensorRT-LLM's DFlash mode does no prompt lookup)."""
    engine = DFlashEngine.load(
        str(target_dir),
        "smollm2-135m",
        dtype="bf16",
        block_size=BLOCK,
        speculation="fixed",
        lookup=False,
        progress=lambda m: None,
    )
    return engine.generate(PROMPT, max_new_tokens=MAX_TOKENS)


def test_the_repository_serves_the_tensorrt_llm_engine_model(server, build_dir):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for model in ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble"):
        assert client.is_model_ready(model)
    assert not (build_dir / "triton_repo" / "dflash").exists()
    assert client.get_model_config("tensorrt_llm").config.model_transaction_policy.decoupled


def test_stream_equals_the_embedded_runtime_with_tensorrt_llm_statistics(server, reference):
    done = complete(server.grpc_url, CompletionRequest(PROMPT, MAX_TOKENS, True), timeout=120)
    assert done.text == reference.text and len(done.pieces) > 1
    s = reference.stats
    assert done.num_tokens == s.num_tokens
    # the engine's own counts (return_perf_metrics): the last step drafts fewer than max_draft_len = BLOCK - 1,
    # which an estimate from decoding_iter (steps x max_draft_len) gets wrong
    assert (done.drafted_tokens, done.accepted_tokens) == (s.drafted_tokens, s.accepted_tokens)
    assert not done.draft_counts_estimated and s.drafted_tokens < s.steps * (BLOCK - 1)
    assert done.acceptance_length == pytest.approx(s.acceptance_length, abs=1e-3)


def test_non_streaming_and_stop_words(server, reference):
    done = complete(server.grpc_url, CompletionRequest(PROMPT, MAX_TOKENS, False), timeout=120)
    assert done.pieces == [reference.text]
    stop = reference.text.split()[3]
    done = complete(server.grpc_url, CompletionRequest(PROMPT, MAX_TOKENS, True, stop_words=(stop,)), timeout=120)
    assert done.text == reference.text[: reference.text.index(stop)] and done.finish_reason == "stop"


def test_an_unsupported_value_is_refused_and_the_server_keeps_serving(server, reference):
    body = json.dumps({"text_input": PROMPT, "max_tokens": MAX_TOKENS, "beam_width": 2}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", data=body)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert "beam_width 2 is not supported" in e.value.read().decode()
    assert complete(server.grpc_url, CompletionRequest(PROMPT, MAX_TOKENS, True), timeout=120).text == reference.text


def test_draft_counts_are_the_engines_and_labelled_where_inferred():
    """count_drafts: the engine's counts when they can be true; otherwise inferred from decoding_iter and said so."""

    def spec(drafted, accepted):
        return SimpleNamespace(
            speculative_decoding=SimpleNamespace(total_draft_tokens=drafted, total_accepted_draft_tokens=accepted)
        )

    stats = GenerationStats(num_tokens=24)
    count_drafts(stats, decoding_iter=11, perf_metrics=spec(28, 13), max_draft_len=3)
    assert (stats.steps, stats.drafted_tokens, stats.accepted_tokens, stats.draft_counts_estimated) == (
        10,
        28,
        13,
        False,
    )
    for metrics in (None, spec(0, 0)):  # no metrics, or a release whose PyTorch flow leaves them at zero
        count_drafts(stats, decoding_iter=11, perf_metrics=metrics, max_draft_len=3)
        assert (stats.drafted_tokens, stats.accepted_tokens, stats.draft_counts_estimated) == (30, 13, True)
    stats = GenerationStats(
        num_tokens=11
    )  # one token a step: zero accepted is true, zero drafted possible (schedule 0)
    count_drafts(stats, decoding_iter=11, perf_metrics=spec(0, 0), max_draft_len=3)
    assert (stats.drafted_tokens, stats.accepted_tokens, stats.draft_counts_estimated) == (0, 0, False)


def test_a_stop_string_aborts_once_and_finish_reasons_pass_through(target_dir, build_dir):
    """llm_steps on the embedded LLM: one abort() for a stop string (upstream's abort is unguarded), and the
    engine's 'cancelled' is not reported as 'length'."""
    from transformers import AutoTokenizer

    from trtllm_dflash.config import SamplingParams as Sampling
    from trtllm_dflash.deploy.trtllm.embedded import LLM, SamplingParams
    from trtllm_dflash.serving.protocol import EngineRequest

    llm = LLM(
        str(target_dir),
        speculative_config={
            "decoding_type": "DFlash",
            "max_draft_len": BLOCK - 1,
            "speculative_model": str(build_dir / "checkpoints/draft"),
        },
    )
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    results = []
    generate = llm.generate_async
    llm.generate_async = lambda *a, **k: results.append(generate(*a, **k)) or results[-1]  # a spy: the call is real
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    text = "".join(
        d
        for _, d in llm_steps(
            llm,
            SamplingParams,
            EngineRequest(prompt, MAX_TOKENS, Sampling(0.0)),
            GenerationStats(),
            tokenizer,
            BLOCK - 1,
        )
    )
    stop = text.split()[2]
    stats = GenerationStats()
    job = EngineRequest(prompt, MAX_TOKENS, Sampling(0.0), stop_strings=(stop,))
    list(llm_steps(llm, SamplingParams, job, stats, tokenizer, BLOCK - 1))
    assert stats.finish_reason == "stop" and results[-1].aborts == 1
    stats = GenerationStats()
    steps = llm_steps(
        llm, SamplingParams, EngineRequest(prompt, MAX_TOKENS, Sampling(0.0)), stats, tokenizer, BLOCK - 1
    )
    next(steps)
    results[-1].abort()  # the engine cancels (as TensorRT-LLM does on a client's cancellation)
    list(steps)
    assert results[-1].outputs[0].finish_reason == "cancelled" and stats.finish_reason == "cancelled"


def test_mpi_job_variables_are_cleared_and_configuration_kept():
    env = {
        "OMPI_COMM_WORLD_SIZE": "1",
        "PMIX_RANK": "0",
        "PMI_SIZE": "1",
        "OMPI_MCA_orte_ess_num_procs": "1",
        "OMPI_MCA_btl": "^openib",
        "PMIX_MCA_gds": "hash",
        "PATH": "/bin",
    }
    assert clear_mpi_job_env(env) == ["OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_ess_num_procs", "PMIX_RANK", "PMI_SIZE"]
    assert env == {"OMPI_MCA_btl": "^openib", "PMIX_MCA_gds": "hash", "PATH": "/bin"}
