"""The TensorRT-LLM backend's repository on the REAL tritonserver, on CPU: the `tensorrt_llm` Triton model runs the
same code it runs on a GPU host, with our embedded engine behind the `tensorrt_llm.LLM` API surface
(TRTDFLASH_LLM_ENGINE=embedded). Only the engine swap is not exercised here.
"""

import json
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient

from trtllm_dflash.build import BuildOptions, run_build
from trtllm_dflash.client import CompletionRequest, complete
from trtllm_dflash.runtime import DFlashEngine
from trtllm_dflash.serve import ServerConfig, TritonServer

PROMPT = "What is 7 times 8?"
MAX_TOKENS = 24
BLOCK = 4


@pytest.fixture(scope="module")
def build_dir(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trtllm") / "build"
    return run_build(BuildOptions(output=out, target=str(target_dir), draft="smollm2-135m", backend="trtllm", block_size=BLOCK,
                                  max_seq_len=256, max_batch_size=2), progress=lambda m: None)


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
    engine = DFlashEngine.load(str(target_dir), "smollm2-135m", dtype="bf16", block_size=BLOCK, speculation="fixed", lookup=False,
                               progress=lambda m: None)
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
    # decoding_iter counts the context phase and one iteration per verify of max_draft_len = BLOCK - 1 drafts
    assert done.drafted_tokens == s.steps * (BLOCK - 1) and done.accepted_tokens == s.num_tokens - 1 - s.steps
    assert done.acceptance_length == pytest.approx(s.acceptance_length, abs=1e-3)


def test_non_streaming_and_stop_words(server, reference):
    done = complete(server.grpc_url, CompletionRequest(PROMPT, MAX_TOKENS, False), timeout=120)
    assert done.pieces == [reference.text]
    stop = reference.text.split()[3]
    done = complete(server.grpc_url, CompletionRequest(PROMPT, MAX_TOKENS, True, stop_words=(stop,)), timeout=120)
    assert done.text == reference.text[:reference.text.index(stop)] and done.finish_reason == "stop"


def test_an_unsupported_value_is_refused_and_the_server_keeps_serving(server, reference):
    body = json.dumps({"text_input": PROMPT, "max_tokens": MAX_TOKENS, "beam_width": 2}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", data=body)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert "beam_width 2 is not supported" in e.value.read().decode()
    assert complete(server.grpc_url, CompletionRequest(PROMPT, MAX_TOKENS, True), timeout=120).text == reference.text
