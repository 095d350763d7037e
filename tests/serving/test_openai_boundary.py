"""The OpenAI frontend's boundary on its own (a real aiohttp server on loopback, no Triton behind it): every malformed
request gets a 4xx JSON error before anything reaches the engine, and the frontend keeps serving."""

import json
import urllib.error
import urllib.request

import pytest

from trtllm_dflash.cli import main
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.serving.openai_server import MAX_BODY, OpenAIFrontend
from trtllm_dflash.serving.serve import ServerConfig, TritonServer
from trtllm_dflash.threads import SPIN_COUNT


@pytest.fixture(scope="module")
def frontend(target_dir, tmp_path_factory):
    build = tmp_path_factory.mktemp("frontend")
    (build / "tokenizer").symlink_to(target_dir)
    manifest = {"options": {"target": "smollm2-135m"}, "resolved": {"max_seq_len": 64}}
    server = OpenAIFrontend(
        build, manifest, grpc_url="127.0.0.1:1", host="127.0.0.1", port=0
    ).start()  # nothing listens on :1
    yield server
    server.stop()


def post(frontend, path, body: bytes):
    req = urllib.request.Request(
        f"http://127.0.0.1:{frontend.port}{path}",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def completion(**fields) -> bytes:
    return json.dumps({"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4, **fields}).encode()


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"[" * 100_000 + b"]" * 100_000, 400, "The request body is not valid JSON."),
        (b'{"prompt": "\xff\xfe"}', 400, "The request body is not valid JSON."),
        (b"x" * (MAX_BODY + 1), 413, "Request Entity Too Large"),
        (completion(stop=["a"] * 65), 400, "'stop' takes at most 64 strings of at most 1024 characters."),
        (completion(stop="s" * 1025), 400, "'stop' takes at most 64 strings of at most 1024 characters."),
        (completion(max_tokens=10**12), 400, "max_tokens is 1000000000000, but the prompt takes"),
        (completion(max_tokens="4"), 400, "'max_tokens' must be an integer, got \"4\"."),
        (completion(temperature=float("nan")), 400, "temperature must be a finite number >= 0, got nan."),
        (completion(seed=-1), 400, "seed must be in [0, 2^64), got -1."),
        (completion(prompt=["a", "b"]), 400, "'prompt' must be a string (or a list holding one string)"),
        (completion(prompt="word " * 200), 400, "context window"),
        (
            json.dumps(
                {"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
            ).encode(),
            400,
            "messages[0].content must be a string or a list of text parts",
        ),
    ],
    ids=[
        "nested",
        "not-utf8",
        "too-large",
        "many-stops",
        "long-stop",
        "max-tokens",
        "max-tokens-type",
        "nan",
        "seed",
        "batch",
        "long-prompt",
        "image",
    ],
)
def test_malformed_requests_get_an_error_and_the_frontend_keeps_serving(frontend, body, status, message):
    path = "/v1/chat/completions" if b"messages" in body[:40] else "/v1/completions"
    got, reply = post(frontend, path, body)
    assert got == status and message in reply["error"]["message"], reply
    got, reply = post(
        frontend, "/v1/completions", completion()
    )  # a valid request passes the boundary: only Triton is missing
    assert got == 503 and reply["error"]["type"] == "server_error", reply


def test_every_endpoint_binds_loopback_by_default_and_the_models_get_the_thread_policy(
    frontend, random_draft_dir, tmp_path, monkeypatch
):
    assert frontend.host == "127.0.0.1" and frontend.port > 0
    host = next(p for p in main.commands["serve"].params if p.name == "host")
    assert host.default == ServerConfig(build_dir=None).host == "127.0.0.1"
    out = run_build(
        BuildOptions(output=tmp_path / "b", draft=str(random_draft_dir), max_seq_len=64, dtype="fp32"),
        progress=lambda m: None,
    )
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cmd, env = TritonServer(ServerConfig(out)).command()
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(cmd)
    assert (
        env["GOMP_SPINCOUNT"] == SPIN_COUNT and env["OMP_NUM_THREADS"] == "1"
    )  # our default, and the user's value wins
    cmd, _ = TritonServer(ServerConfig(out, host="0.0.0.0", grpc_port=9001)).command()
    assert {"--http-address=0.0.0.0", "--grpc-port=9001"} <= set(cmd)
