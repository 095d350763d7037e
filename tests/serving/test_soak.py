"""A bounded soak of the batched server on loopback: mixed streaming and non-streaming requests of mixed lengths from
more clients than slots, some leaving mid-stream. Every request completes with its text served alone (greedy) or,
having left, a prefix of it; no errors; the server stays healthy and its memory returns near where it started."""

import pytest

from trtllm_dflash.clients.loadgen import soak
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.serving.serve import ServerConfig, TritonServer

pytestmark = pytest.mark.slow  # real servers (see pyproject.toml's markers)

PROMPTS = ["The capital of France is", "Name three colors.", "What is 12 times 7?", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    build = run_build(
        BuildOptions(output=tmp_path_factory.mktemp("soak") / "build", max_batch_size=4, max_seq_len=256, dtype="fp32"),
        progress=lambda m: None,
    )
    with TritonServer(ServerConfig(build, grpc_port=0, http_port=0, metrics_port=0)) as s:
        yield s


def test_mixed_load_completes_correctly_and_leaves_the_server_as_it_was(server):
    report = soak(server, PROMPTS, n=48, concurrency=12, lengths=(4, 12))
    assert report["errors"] == [] and report["mismatches"] == []
    assert report["completed"] + report["left"] == 48 and report["left"] >= 4
    assert report["healthy_after"]
    assert report["rss_after_mb"] <= report["rss_before_mb"] * 1.1 + 64, report
