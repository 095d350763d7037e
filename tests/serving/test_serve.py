"""End to end on the REAL tritonserver: build -> serve -> gRPC/HTTP clients -> compare with `trtdflash generate`.

One server per module, on free loopback ports, always stopped (context manager). Greedy decoding
is lossless, so the served text must equal `trtdflash generate` with the same draft and block size.
The packaged default draft is used once it has landed, a random-init draft until then; block size 4
keeps the CPU cost low.
"""

import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from trtllm_dflash.clients.client import CompletionRequest, complete
from trtllm_dflash.config import SamplingParams
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.resolve import resolve_draft
from trtllm_dflash.serving.serve import ServerConfig, TritonServer, free_ports, stop_all

pytestmark = pytest.mark.slow  # real servers (see pyproject.toml's markers)

PROMPT = "Name three colors."
MAX_TOKENS = 24
BLOCK = 4
MAX_SEQ_LEN = 256
TRTDFLASH = str(Path(sys.executable).parent / "trtdflash")


@pytest.fixture(scope="module")
def draft_dir(random_draft_dir):
    """The packaged default draft once it has landed (then the build uses the embedded default), else a random one."""
    return resolve_draft(None, "smollm2-135m") or random_draft_dir


@pytest.fixture(scope="module")
def build_dir(draft_dir, random_draft_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "build"
    draft = None if draft_dir != random_draft_dir else str(draft_dir)
    return run_build(
        BuildOptions(
            output=out,
            draft=draft,
            block_size=BLOCK,
            max_seq_len=MAX_SEQ_LEN,
            max_batch_size=2,
            speculation="fixed",
            dtype="fp32",
        ),  # statistics comparable with `generate --speculation fixed`
        progress=lambda m: None,
    )


@pytest.fixture(scope="module")
def server(build_dir):
    """Always stopped, also when tests fail; after all the module's requests it must still stop promptly."""
    s = TritonServer(ServerConfig(build_dir, grpc_port=0, http_port=0, metrics_port=0)).start()
    try:
        yield s
    finally:
        t0 = time.perf_counter()
        s.stop()
    assert time.perf_counter() - t0 < 20, f"graceful stop waited for requests Triton never released; see {s.log_path}"


@pytest.fixture(scope="module")
def reference(draft_dir):
    """What `trtdflash generate` prints for the same prompt and settings (greedy)."""
    out = subprocess.run(
        [
            TRTDFLASH,
            "generate",
            "--draft",
            str(draft_dir),
            "--block-size",
            str(BLOCK),
            "--max-new-tokens",
            str(MAX_TOKENS),
            "--speculation",
            "fixed",
            "--dtype",
            "fp32",
            "--prompt",
            PROMPT,
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout)


def _complete(server, stream=True, prompt=PROMPT, max_tokens=MAX_TOKENS, **kw):
    return complete(server.grpc_url, CompletionRequest(prompt, max_tokens, stream, **kw), timeout=120)


def _post(server, path, body):
    req = urllib.request.Request(
        f"http://{server.http_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_server_is_ready_and_streams_through_a_decoupled_model(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_ready()
    for model in ("preprocessing", "dflash", "postprocessing", "ensemble"):
        assert client.is_model_ready(model)
    assert client.get_model_config("dflash").config.model_transaction_policy.decoupled
    assert client.get_model_metadata("ensemble").platform == "ensemble"


def test_grpc_stream_equals_generate(server, reference):
    done = _complete(server, stream=True)
    assert done.text == reference["text"]
    assert len(done.pieces) > 1, "streaming should deliver several responses"
    assert done.num_tokens == reference["num_tokens"] == len(reference["token_ids"])
    assert done.drafted_tokens == reference["drafted_tokens"] and done.accepted_tokens == reference["accepted_tokens"]
    assert done.acceptance_length == pytest.approx(reference["acceptance_length"], abs=1e-3)
    assert done.finish_reason == reference["finish_reason"]


def test_grpc_non_stream_is_one_response_with_the_same_text(server, reference):
    done = _complete(server, stream=False)
    assert done.pieces == [reference["text"]]


def test_http_generate_and_generate_stream(server, reference):
    status, body = _post(server, "/v2/models/ensemble/generate", {"text_input": PROMPT, "max_tokens": MAX_TOKENS})
    assert status == 200 and json.loads(body)["text_output"] == reference["text"]
    status, body = _post(
        server, "/v2/models/ensemble/generate_stream", {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    )
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) > 1
    assert "".join(e["text_output"] for e in events) == reference["text"]
    assert events[-1]["num_output_tokens"] == reference["num_tokens"]


def test_cli_client_json(server, reference):
    out = subprocess.run(
        [TRTDFLASH, "client", "--url", server.grpc_url, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    got = json.loads(out.stdout)
    assert got["text"] == reference["text"] and got["num_tokens"] == reference["num_tokens"]
    assert got["time_to_first_token"] > 0 and got["tokens_per_second"] > 0 and "acceptance_length" in got


def test_cli_bench_loads_the_server_and_reports_every_request(server, tmp_path):
    """`trtdflash bench` against the real server, named twice: at each level every request streams the tokens asked
    for, and the table, the results JSON and the plot report it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Write a long story about a dragon who learns to bake bread."})
        + "\nList every month of the year with one fact about each.\n"
    )
    out = subprocess.run(
        [
            TRTDFLASH,
            "bench",
            "--url",
            f"a={server.grpc_url}",
            "--url",
            f"b={server.grpc_url}",
            "--concurrency",
            "1,2",
            "--requests",
            "3",
            "--max-tokens",
            "8",
            "--prompts",
            str(prompts),
            "--output",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert list(report["levels"]) == ["a", "b"] and report["num_prompts"] == 2
    for levels in report["levels"].values():
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for lv in levels:
            assert lv["completed"] == 3 and lv["errors"] == [] and lv["tokens"] == 3 * 8
            assert lv["steady_tokens_per_s"] > 0 and lv["ttft_p50_s"] > 0 and lv["acceptance_length_median"] >= 1
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [line.split() for line in out.stdout.splitlines() if line[:5].strip().isdigit()]
    assert [r[:2] for r in rows] == [["1", "a"], ["1", "b"], ["2", "a"], ["2", "b"]]
    assert all(r[-1].endswith("x") for r in rows[1::2]) and not any(r[-1].endswith("x") for r in rows[::2])


def test_concurrent_streams_all_complete(server, reference):
    """Three streams on a build with max_batch_size 2: two run interleaved, the third waits for a slot."""
    results, errors = [None] * 3, []

    def run(i):
        try:
            results[i] = _complete(server, stream=True)
        except Exception as e:  # collected, asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert [r.text for r in results] == [reference["text"]] * 3


def test_engine_metrics_on_the_metrics_port(server, reference):
    """After requests, a Prometheus scrape shows the engine: steps, tokens, drafted/accepted, block lengths, idle gauges."""
    _complete(server)
    deadline = time.time() + 10
    while True:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
            text = r.read().decode()
        values = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^(dflash_\w+)\{[^}]*model="dflash"[^}]*\} (\S+)$', text, re.M)
        }
        if values.get("dflash_running") == 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert values["dflash_steps_total"] >= reference["steps"]
    assert values["dflash_generated_tokens_total"] >= reference["num_tokens"]
    assert 0 < values["dflash_accepted_tokens_total"] <= values["dflash_drafted_tokens_total"]
    assert (
        values["dflash_lookup_accepted_tokens_total"] <= values["dflash_accepted_tokens_total"]
    )  # lookup's share, published
    # the same chat prompt served more than once: at least the template's head came from the prefix cache
    assert 0 < values["dflash_cached_prompt_tokens_total"] < values["dflash_prompt_tokens_total"]
    assert values["dflash_acceptance_length"] > 1 and values["dflash_running"] == 0 and values["dflash_queued"] == 0
    assert f'dflash_block_length_steps_total{{block_length="{BLOCK}",model="dflash"}}' in text


def _raw_stream(server, arrays: dict, outputs=None) -> tuple[list, list]:
    """Send hand-made inputs (optionally asking for some outputs only); returns (results, errors) until the final response or an error."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = []
    for name, (arr, dtype) in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client.async_stream_infer(
        "ensemble",
        inputs,
        enable_empty_final_response=True,
        outputs=outputs and [grpcclient.InferRequestedOutput(name) for name in outputs],
    )
    results, errors = [], []
    while True:
        result, error = q.get(timeout=120)
        if error is not None:
            errors.append(error)
            break
        results.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return results, errors


def _text(s):
    return (np.array([[s]], dtype=np.object_), "BYTES")


def _i32(v):
    return (np.array([[v]], dtype=np.int32), "INT32")


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"max_tokens": _i32(8)}, "text_input"),
        ({"text_input": _text(b"Hi"), "max_tokens": _i32(0)}, "max_tokens must be between 1 and 256"),
        ({"text_input": _text(b"Hi"), "max_tokens": _i32(10**6)}, "max_tokens must be between 1 and 256"),
        ({"text_input": _text(b"word " * 300), "max_tokens": _i32(8)}, "context window is 256"),
        ({"text_input": _text(b"word " * 100), "max_tokens": _i32(200)}, "exceeds max_seq_len 256"),
        (
            {
                "text_input": _text(b"Hi"),
                "max_tokens": _i32(8),
                "temperature": (np.array([[-1.0]], np.float32), "FP32"),
            },
            "temperature",
        ),
        (
            {"text_input": _text(b"Hi"), "max_tokens": _i32(8), "top_p": (np.array([[1.5]], np.float32), "FP32")},
            "top_p must be in [0, 1]",
        ),
        ({"text_input": _text(b"Hi"), "max_tokens": _i32(8), "top_k": _i32(-3)}, "top_k"),
        ({"text_input": _text(b"\xff\xfe bad"), "max_tokens": _i32(8)}, "not valid UTF-8"),
        ({"text_input": _text(b""), "max_tokens": _i32(8)}, "prompt is empty"),
        ({"text_input": _text(b"Hi"), "max_tokens": _i32(8), "end_id": _i32(10**7)}, "end_id"),
        (
            {"text_input": _text(b"Hi"), "max_tokens": _i32(8), "bad_words": (np.array([[b"x"]], np.object_), "BYTES")},
            "bad_words",
        ),
    ],
)
def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, arrays, message):
    results, errors = _raw_stream(server, arrays)
    assert len(errors) == 1 and message in errors[0].message(), errors
    assert client_ok(server)


def client_ok(server) -> bool:
    return _complete(server, max_tokens=2).num_tokens == 2


def test_cli_client_reports_a_rejection_as_one_sentence(server):
    out = subprocess.run(
        [TRTDFLASH, "client", "--url", server.grpc_url, "--prompt", PROMPT, "--max-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (
        out.stderr.startswith("Error: The server rejected the request:")
        and "max_tokens must be between 1 and 256" in out.stderr
    )


def _ensemble_requests_done(server) -> int:
    """Ensemble requests the server has finished (success + failure), from its Prometheus metrics."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        int(float(v))
        for v in re.findall(r'nv_inference_request_(?:success|failure)\{[^}]*model="ensemble"[^}]*\} (\S+)', text)
    )


def test_client_disconnect_mid_stream_does_not_wedge_the_model(server, reference):
    before = _ensemble_requests_done(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    request = CompletionRequest("Write a long story about a dragon.", MAX_SEQ_LEN - 64, True)
    client.async_stream_infer("ensemble", request.inputs(), enable_empty_final_response=True)
    result, error = got.get(timeout=120)
    assert error is None
    client.stop_stream(cancel_requests=True)  # the client goes away mid-stream
    client.close()
    t0 = time.perf_counter()
    assert _complete(server).text == reference["text"]
    assert time.perf_counter() - t0 < 60
    deadline = time.monotonic() + 30  # the abandoned generation is noticed and stopped early
    while time.monotonic() < deadline and "request cancelled" not in server.log_path.read_text(errors="replace"):
        time.sleep(0.5)
    cancelled = re.findall(r"request cancelled after (\d+) tokens", server.log_path.read_text(errors="replace"))
    assert cancelled and int(cancelled[-1]) < MAX_SEQ_LEN - 64
    deadline = time.monotonic() + 30  # and the abandoned ensemble request is finished, not left in flight
    while time.monotonic() < deadline and _ensemble_requests_done(server) < before + 2:
        time.sleep(0.5)
    assert _ensemble_requests_done(server) == before + 2


def test_serve_cli_prints_endpoints_and_stops_gracefully_on_sigterm(build_dir):
    grpc_port, http_port, metrics_port, openai_port = free_ports(4)
    proc = subprocess.Popen(
        [
            TRTDFLASH,
            "serve",
            str(build_dir),
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--metrics-port",
            str(metrics_port),
            "--openai-port",
            str(openai_port),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("log "):
                break
        assert "Ready.\n" in lines and f"gRPC     127.0.0.1:{grpc_port}" in "".join(lines), "".join(lines)
        assert grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}").is_server_ready()
        done = complete(f"127.0.0.1:{grpc_port}", CompletionRequest("Hi", 64, True), timeout=120)
        assert done.finish_reason == "stop" and done.text  # ends on EOS: the last delta is empty
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.perf_counter() - t0 < 20, "graceful stop waited for a request the ensemble never released"
        assert "stopping tritonserver gracefully" in proc.stderr.read()
        with pytest.raises(InferenceServerException):
            grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}").is_server_live()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def test_stop_all_stops_servers_side_by_side_each_gracefully_and_once(build_dir):
    """The quickstart's two servers are stopped together: each gets one SIGTERM and exits cleanly, and the servers
    unload their models at the same time rather than one after the other."""
    servers = []
    try:
        for _ in range(2):
            servers.append(TritonServer(ServerConfig(build_dir, grpc_port=0, http_port=0, metrics_port=0)).start())
        for s in servers:
            assert complete(s.grpc_url, CompletionRequest("Hi", 8), timeout=120).text
        stop_all(servers)
        assert [s.proc.returncode for s in servers] == [0, 0]
        assert [s.stop() for s in servers] == [0, 0]  # stopping again is a no-op
        unloaded = [
            re.findall(r"^I\d+ (\d\d:\d\d:\d\d\.\d+) .*successfully unloaded 'dflash'", s.log_path.read_text(), re.M)
            for s in servers
        ]
        assert all(len(u) == 1 for u in unloaded), unloaded
        first, second = (sum(float(x) * 60 ** (2 - i) for i, x in enumerate(u[0].split(":"))) for u in unloaded)
        assert abs(first - second) < 2.0, unloaded  # side by side: one unload does not wait for the other's server
    finally:
        for s in servers:
            s.stop()


def test_examples_run_against_the_server(server, reference):
    root = Path(__file__).resolve().parents[2] / "examples"
    out = subprocess.run(
        [
            sys.executable,
            str(root / "grpc_stream_client.py"),
            "--url",
            server.grpc_url,
            "--prompt",
            PROMPT,
            "--max-tokens",
            str(MAX_TOKENS),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.rstrip("\n") == reference["text"].rstrip("\n") and "acceptance length" in out.stderr
    if shutil.which("curl"):
        out = subprocess.run(
            [str(root / "http_generate_stream.sh"), server.http_url, PROMPT],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        events = [json.loads(line[len("data: ") :]) for line in out.stdout.splitlines() if line.startswith("data: ")]
        assert events and events[-1]["finish_reason"]


def test_stop_words_and_seeded_sampling(server, reference):
    cut = reference["text"].index(reference["text"].split()[2])  # stop at the third word
    done = _complete(server, stop_words=(reference["text"].split()[2],))
    assert done.text == reference["text"][:cut] and done.finish_reason == "stop"
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    first, second = (_complete(server, max_tokens=12, sampling=sampling) for _ in range(2))
    assert first.text and first.text == second.text
    assert first.num_tokens == 12 or first.finish_reason == "stop"


def test_exclude_input_in_output_false_prepends_the_prompt(server, reference):
    results, errors = _raw_stream(
        server,
        {
            "text_input": _text(PROMPT.encode()),
            "max_tokens": _i32(MAX_TOKENS),
            "exclude_input_in_output": (np.array([[False]]), "BOOL"),
        },
    )
    assert not errors
    text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in results if r.get_response().outputs)
    assert PROMPT in text and text.endswith(reference["text"]) and len(text) > len(reference["text"])


# Clients written for Triton's TensorRT-LLM ensemble (inputs as the upstream clients build them).


def _array(value, dtype):
    return (
        np.array([[value]], dtype=dtype),
        {np.int32: "INT32", np.float32: "FP32", bool: "BOOL", np.uint64: "UINT64"}[dtype],
    )


def _joined(results) -> str:
    return "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in results if r.get_response().outputs)


@pytest.mark.parametrize("stream", [True, False])
def test_tensorrt_llm_end_to_end_client_inputs(server, reference, stream):
    """What inflight_batcher_llm/client/end_to_end_grpc_client.py sends with --exclude-input-in-output (and -n 1):
    temperature 1.0 without top_k/top_p is greedy in TensorRT-LLM's meaning, so the text is generate's."""
    arrays = {
        "text_input": _text(PROMPT),
        "max_tokens": _i32(MAX_TOKENS),
        "stream": _array(stream, bool),
        "beam_width": _i32(1),
        "temperature": _array(1.0, np.float32),
        "num_return_sequences": _i32(1),
        "exclude_input_in_output": _array(True, bool),
    }
    results, errors = _raw_stream(server, arrays, outputs=["text_output"])
    assert not errors and _joined(results) == reference["text"]
    responses = len([r for r in results if r.get_response().outputs])
    assert responses > 1 if stream else responses == 1


@pytest.mark.parametrize("stream", [True, False])
def test_genai_perf_tensorrtllm_inputs(server, reference, stream):
    """genai-perf --service-kind triton --backend tensorrtllm: text_input, max_tokens, exclude_input_in_output, stream."""
    arrays = {
        "text_input": _text(PROMPT),
        "max_tokens": _i32(MAX_TOKENS),
        "exclude_input_in_output": _array(True, bool),
    }
    if stream:
        arrays["stream"] = _array(True, bool)
    results, errors = _raw_stream(server, arrays)
    assert not errors and _joined(results) == reference["text"]


NEUTRAL = {  # default values of the inputs we honour only at their default
    "beam_width": _i32(1),
    "num_return_sequences": _i32(1),
    "pad_id": _i32(0),
    "length_penalty": _array(1.0, np.float32),
    "repetition_penalty": _array(1.0, np.float32),
    "presence_penalty": _array(0.0, np.float32),
    "frequency_penalty": _array(0.0, np.float32),
    "min_tokens": _i32(0),
    "return_log_probs": _array(False, bool),
    "return_context_logits": _array(False, bool),
    "return_generation_logits": _array(False, bool),
    "return_perf_metrics": _array(True, bool),
    "return_num_input_tokens": _array(True, bool),
    "return_num_output_tokens": _array(True, bool),
    "decoder_text_input": _text(b""),
    "bad_words": _text(b""),
    "embedding_bias_words": _text(b""),
    "guided_decoding_guide_type": _text(b""),
    "guided_decoding_guide": _text(b""),
}


def test_every_neutral_value_at_once_is_plain_greedy(server, reference):
    results, errors = _raw_stream(server, {"text_input": _text(PROMPT), "max_tokens": _i32(MAX_TOKENS), **NEUTRAL})
    assert not errors and _joined(results) == reference["text"]


UNSUPPORTED = [
    (
        "beam_width",
        _i32(4),
        "beam_width 4 is not supported: DFlash speculative decoding runs one beam; send beam_width 1.",
    ),
    ("num_return_sequences", _i32(3), "num_return_sequences 3 is not supported"),
    ("repetition_penalty", _array(1.3, np.float32), "repetition_penalty 1.3 is not supported"),
    ("presence_penalty", _array(0.5, np.float32), "presence_penalty 0.5 is not supported"),
    ("frequency_penalty", _array(0.5, np.float32), "frequency_penalty 0.5 is not supported"),
    ("return_log_probs", _array(True, bool), "return_log_probs true is not supported"),
    ("return_context_logits", _array(True, bool), "return_context_logits true is not supported"),
    ("return_generation_logits", _array(True, bool), "return_generation_logits true is not supported"),
    ("decoder_text_input", _text(b"hola"), "decoder_text_input 'hola' is not supported"),
    (
        "embedding_bias_words",
        (np.array([[b"red", b"blue"]], np.object_), "BYTES"),
        "embedding_bias_words 'red' is not supported",
    ),
    (
        "embedding_bias_weights",
        (np.array([[0.5, 1.0]], np.float32), "FP32"),
        "A non-empty embedding_bias_weights is not supported",
    ),
    (
        "prompt_embedding_table",
        (np.ones((1, 2, 576), np.float16), "FP16"),
        "A non-empty prompt_embedding_table is not supported",
    ),
    ("prompt_table_extra_id", _array(5, np.uint64), "prompt_table_extra_id 5 is not supported"),
    ("prompt_vocab_size", _i32(2), "prompt_vocab_size 2 is not supported"),
    ("lora_task_id", _array(1, np.uint64), "lora_task_id 1 is not supported: LoRA adapters are not supported"),
    ("lora_weights", (np.ones((1, 2, 16), np.float16), "FP16"), "A non-empty lora_weights is not supported"),
    ("lora_config", (np.ones((1, 2, 3), np.int32), "INT32"), "A non-empty lora_config is not supported"),
    ("guided_decoding_guide_type", _text(b"json_schema"), "guided_decoding_guide_type 'json_schema' is not supported"),
    ("guided_decoding_guide", _text(b"{}"), "guided_decoding_guide '{}' is not supported"),
]


def test_each_unsupported_value_is_rejected_and_the_next_request_succeeds(server):
    for name, value, message in UNSUPPORTED:
        results, errors = _raw_stream(server, {"text_input": _text(b"Hi"), "max_tokens": _i32(4), name: value})
        assert len(errors) == 1 and message in errors[0].message(), (name, errors)
        ok, errors = _raw_stream(server, {"text_input": _text(b"Hi"), "max_tokens": _i32(1), "beam_width": _i32(1)})
        assert not errors and ok[-1].as_numpy("num_output_tokens").reshape(-1)[0] == 1, name


def test_standard_outputs_are_consistent(server, reference):
    results, errors = _raw_stream(
        server,
        {
            "text_input": _text(PROMPT),
            "max_tokens": _i32(MAX_TOKENS),
            "stream": _array(True, bool),
            "return_perf_metrics": _array(True, bool),
        },
    )
    assert not errors
    last = {
        name: results[-1].as_numpy(name).reshape(-1)[0]
        for name in (
            "num_input_tokens",
            "num_output_tokens",
            "total_draft_tokens",
            "total_accepted_draft_tokens",
            "acceptance_rate",
            "acceptance_length",
            "finish_reason",
            "batch_index",
            "sequence_index",
            "arrival_time_ns",
            "first_scheduled_time_ns",
            "first_token_time_ns",
            "last_token_time_ns",
        )
    }
    assert last["num_input_tokens"] == reference["prompt_tokens"]
    assert last["num_output_tokens"] == reference["num_tokens"] == len(reference["token_ids"])
    assert (last["total_draft_tokens"], last["total_accepted_draft_tokens"]) == (
        reference["drafted_tokens"],
        reference["accepted_tokens"],
    )
    assert last["acceptance_rate"] == pytest.approx(
        reference["accepted_tokens"] / reference["drafted_tokens"], abs=1e-6
    )
    assert last["acceptance_length"] == pytest.approx(reference["acceptance_length"], abs=1e-3)
    assert (
        last["finish_reason"].decode() == reference["finish_reason"]
        and last["batch_index"] == last["sequence_index"] == 0
    )
    assert (
        0
        < last["arrival_time_ns"]
        <= last["first_scheduled_time_ns"]
        <= last["first_token_time_ns"]
        < last["last_token_time_ns"]
    )
    firsts = {int(r.as_numpy("first_token_time_ns").reshape(-1)[0]) for r in results if r.get_response().outputs}
    assert len(firsts) == 1  # the first token's time stays put while later responses stream


def test_min_tokens_holds_back_eos(server):
    natural, errors = _raw_stream(server, {"text_input": _text(b"Hi"), "max_tokens": _i32(64)})
    n = int(natural[-1].as_numpy("num_output_tokens").reshape(-1)[0])
    assert not errors and natural[-1].as_numpy("finish_reason").reshape(-1)[0] == b"stop"
    held, errors = _raw_stream(
        server, {"text_input": _text(b"Hi"), "max_tokens": _i32(n + 3), "min_tokens": _i32(n + 3)}
    )
    assert not errors and held[-1].as_numpy("num_output_tokens").reshape(-1)[0] == n + 3
    assert held[-1].as_numpy("finish_reason").reshape(-1)[0] == b"length"
