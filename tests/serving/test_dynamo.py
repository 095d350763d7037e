"""A REAL NVIDIA Dynamo fleet: Dynamo's own frontend (OpenAI API, KV router) and two DFlash workers, started by
`trtdflash serve --dynamo` as a user starts it, on loopback, with file discovery and ZMQ events (no etcd, no NATS).

Greedy decoding is lossless, so every answer must equal the embedded engine's on the same tokens: through Dynamo's
chat rendering, after the KV router sent a later turn to the worker that caches its prefix, and after a worker died
under load and the frontend moved its streams to the other. The fleet's last test stops it with Ctrl-C.
"""

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
import torch
from transformers import AutoTokenizer

from trtllm_dflash.config import ENGINE_FILE, EngineOptions
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.resolve import resolve_draft
from trtllm_dflash.serving.dynamo_worker import RouterBlocks, block_hashes

pytestmark = pytest.mark.slow  # real servers (see pyproject.toml's markers)

MODEL = "smollm2-135m"
PROMPTS = [
    "A train travels 60 km in 45 minutes. What is its speed in km/h?",
    "Write a Python function that returns the factorial of n.",
    "Name three primary colors.",
]
SYSTEM = (  # long enough that each conversation's first prefill chunks are whole and kept by the prefix cache
    "You are a patient tutor. You explain arithmetic word problems step by step, you check every unit conversion, "
    "you name the formula you use before you use it, and you end every answer with a single line that starts "
    "with 'Answer:' and gives the result with its unit."
)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def build_dir(request, tmp_path_factory):
    draft = None if resolve_draft(None, MODEL) else str(request.getfixturevalue("random_draft_dir"))
    return run_build(
        BuildOptions(
            output=tmp_path_factory.mktemp("dynamo") / "build",
            draft=draft,
            block_size=4,
            max_seq_len=512,
            max_batch_size=4,
            speculation="fixed",
            dtype="fp32",  # greedy DFlash is token-identical to the target's own in fp32 on every path
        ),
        progress=lambda m: None,
    )


@pytest.fixture(scope="module")
def engine(build_dir):
    """The reference: the build's own engine in this process."""
    from trtllm_dflash.engine.runtime import DFlashEngine

    here = build_dir / "triton_repo" / "dflash"
    opts = EngineOptions.from_json((here / ENGINE_FILE).read_text(), "engine.json")
    return DFlashEngine.from_options(opts, here, progress=lambda m: None)


def reference(engine, ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    with torch.inference_mode():
        return "".join(text for _, text in engine.stream(ids, max_new_tokens=max_tokens))


class FleetProcess:
    """`trtdflash serve BUILD --dynamo --workers 2` as a subprocess; its endpoints read from what it prints."""

    def __init__(self, build_dir):
        cmd = [sys.executable, "-m", "trtllm_dflash.cli", "serve", str(build_dir), "--dynamo", "--http-port", "0"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + 300
        while not any(line.startswith("logs") for line in self.lines):
            line = self.proc.stderr.readline()
            assert line or self.proc.poll() is None, "serve --dynamo exited:\n" + "".join(self.lines)
            assert time.monotonic() < deadline, "serve --dynamo was not ready in 300 s:\n" + "".join(self.lines)
            self.lines.append(line)
        text = "".join(self.lines)
        self.url = re.search(r"OpenAI\s+(http://\S+)/v1", text).group(1)
        self.metrics = re.findall(r"worker \d+\s+(http://\S+/metrics)", text)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def counters(
        self, names=("dflash_prompt_tokens_total", "dflash_cached_prompt_tokens_total")
    ) -> list[dict[str, float]]:
        """Per worker: its engine's counters `names` (default: prompt tokens, prefix-cache hits), from its /metrics."""
        out = []
        for url in self.metrics:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            values = {}
            for name in names:
                values[name] = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))
            out.append(values)
        return out

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def chat(self, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return self.post("/v1/chat/completions", body)


@pytest.fixture(scope="module")
def fleet(build_dir):
    f = FleetProcess(build_dir)
    try:
        yield f
    finally:
        if f.proc.poll() is None:
            f.proc.send_signal(signal.SIGINT)
            try:
                f.proc.wait(60)
            except subprocess.TimeoutExpired:
                f.proc.kill()
        for child in f.children:
            if child.is_running():
                child.kill()


def test_router_blocks_publish_each_block_once_and_remove_it_after_its_last_entry():
    """The cache's chunks as router blocks: two prompts sharing their first 20 tokens share the first block."""
    events = []

    class Publisher:
        def publish_stored(self, **event):
            events.append(("stored", event))

        def publish_removed(self, **event):
            events.append(("removed", event))

    blocks = RouterBlocks()
    blocks.publisher = Publisher()
    a, b = list(range(40)), list(range(20)) + list(range(100, 120))
    blocks.stored(b"a0", a, 0, 40)  # blocks 0 and 1 (tokens 0-31); 8 tokens left over
    blocks.stored(b"b0", b, 0, 40)  # block 0 is held already: only b's block 1
    ha, hb = block_hashes(a, 2), block_hashes(b, 2)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert events[0] == (
        "stored",
        {"token_ids": a[:32], "num_block_tokens": [16, 16], "block_hashes": ha, "parent_hash": None},
    )
    assert events[1] == (
        "stored",
        {"token_ids": b[16:32], "num_block_tokens": [16], "block_hashes": hb[1:], "parent_hash": hb[0]},
    )
    blocks.removed(b"a0")
    assert events[2] == ("removed", {"block_hashes": [ha[1]]})  # block 0 is still b's
    blocks.removed(b"b0")
    assert events[3] == ("removed", {"block_hashes": hb})


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dynamo", "--grpc-port", "9001"], "--grpc-port: Triton's endpoints only"),
        (["--workers", "3"], "--workers: a Dynamo fleet's only; add --dynamo"),
        (["--dynamo", "--workers", "0"], "0 is not in the range"),
    ],
)
def test_serve_refuses_in_one_sentence_what_the_other_server_takes(build_dir, args, message):
    from click.testing import CliRunner

    from trtllm_dflash.cli import main

    result = CliRunner().invoke(main, ["serve", str(build_dir), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_greedy_text_through_dynamos_chat_rendering_equals_the_engines(fleet, engine, build_dir):
    """Dynamo's frontend renders the chat template and detokenizes: the same prompt tokens as text.encode_prompt (a
    prompt of those token ids answers the same), the same text as the engine."""
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        chat = fleet.chat([{"role": "user", "content": prompt}])
        completion = fleet.post(
            "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
        )
        expected = reference(engine, ids)
        assert chat["usage"]["prompt_tokens"] == len(ids)
        assert chat["choices"][0]["message"]["content"] == expected
        assert completion["choices"][0]["text"] == expected
        assert chat["choices"][0]["finish_reason"] == completion["choices"][0]["finish_reason"]


def test_stop_strings_budgets_sampling_and_refusals_through_the_frontend(fleet, engine):
    """The frontend's stop strings cut the engine's text; max_tokens ends it "length"; a seeded sample repeats; an
    option the runtime cannot honour is refused with its sentence, and the fleet answers on."""
    messages = [{"role": "user", "content": PROMPTS[2]}]
    expected = reference(engine, engine.encode(PROMPTS[2]))
    word = expected.split()[2]
    stopped = fleet.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [word]},
    )["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == expected[: expected.index(word)]
    short = fleet.chat(messages, max_tokens=3)
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3
    sample = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    first, again = (fleet.post("/v1/chat/completions", sample)["choices"][0]["message"]["content"] for _ in range(2))
    assert first == again
    with pytest.raises(urllib.error.HTTPError) as refused:
        fleet.post("/v1/chat/completions", sample | {"presence_penalty": 0.5})
    assert "presence_penalty=0.5 is not supported by the DFlash runtime" in refused.value.read().decode()
    assert fleet.chat(messages)["choices"][0]["message"]["content"] == expected


def test_a_client_that_leaves_cancels_its_request_in_the_engine(fleet):
    """A stream dropped after its first chunk stops decoding at the next step: the worker's engine retires the request
    having generated far fewer tokens than it asked for."""

    def totals():
        return fleet.counters(("dflash_requests_finished_total", "dflash_generated_tokens_total"))

    before = totals()
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 400}
    body |= {"temperature": 0, "stream": True, "ignore_eos": True}
    req = urllib.request.Request(
        fleet.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        next(line for line in r if line.startswith(b"data:"))

    def retired(rows):
        return sum(
            a["dflash_requests_finished_total"] - b["dflash_requests_finished_total"] for a, b in zip(rows, before)
        )

    deadline = time.monotonic() + 30
    while not retired(after := totals()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert retired(after) == 1
    generated = sum(
        a["dflash_generated_tokens_total"] - b["dflash_generated_tokens_total"] for a, b in zip(after, before)
    )
    assert 0 < generated < 200


def test_later_turns_land_on_the_worker_that_caches_their_prefix(fleet, engine, build_dir):
    """The KV router reads the workers' prefix caches (their KV events): every later turn of a conversation goes to
    the worker that served its first, whose prefix-cache hit counter rises by what the response reports cached;
    the answer is the engine's on the whole conversation."""
    tokenizer = AutoTokenizer.from_pretrained(build_dir / "tokenizer")
    for conversation in range(3):
        messages = [
            {"role": "system", "content": f"Conversation {conversation}. {SYSTEM}"},
            {"role": "user", "content": f"A shop sells {conversation + 3} apples for 2 dollars. What do 12 cost?"},
        ]
        served = set()
        for turn in range(3):
            before = fleet.counters()
            response = fleet.chat(messages)
            after = fleet.counters()
            prompt = [a["dflash_prompt_tokens_total"] - b["dflash_prompt_tokens_total"] for a, b in zip(after, before)]
            hits = [
                a["dflash_cached_prompt_tokens_total"] - b["dflash_cached_prompt_tokens_total"]
                for a, b in zip(after, before)
            ]
            worker = max(range(len(prompt)), key=lambda i: prompt[i])
            assert prompt[worker] == response["usage"]["prompt_tokens"] and sum(prompt) == prompt[worker]
            cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert hits[worker] == cached
            if turn:
                assert cached > 0, f"conversation {conversation}, turn {turn}: no prefix-cache hit"
            served.add(worker)
            answer = response["choices"][0]["message"]["content"]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert answer == reference(engine, list(ids))
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why? Briefly."}]
        assert len(served) == 1, f"conversation {conversation} was served by workers {sorted(served)}"


def test_a_worker_killed_under_load_leaves_the_fleet_answering(fleet, engine):
    """SIGKILL one worker while six streams are decoding: each stream ends completed (moved to the other worker by the
    frontend's migration, same greedy text) or with an error that says so; then the fleet answers new requests."""
    results: list = [None] * 6
    started = threading.Barrier(7)
    streaming = [threading.Event() for _ in range(6)]

    def stream(i):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS[i % 3]}],
            "max_tokens": 96,
            "temperature": 0,
            "stream": True,
        }
        req = urllib.request.Request(
            fleet.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        text, finish = [], None
        try:
            started.wait(60)
            with urllib.request.urlopen(req, timeout=180) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        results[i] = ("error", json.dumps(event["error"]))
                        return
                    choice = event["choices"][0]
                    text.append(choice["delta"].get("content") or "")
                    streaming[i].set()
                    finish = choice.get("finish_reason") or finish
            results[i] = ("done", "".join(text), finish)
        except urllib.error.HTTPError as e:
            results[i] = ("error", e.read().decode())
        except Exception as e:  # a cut connection is an error the client sees, not a hang
            results[i] = ("error", f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(60)
    assert all(e.wait(120) for e in streaming)
    assert all(r is None for r in results), "a stream ended before the worker was killed: raise max_tokens"
    workers = [c for c in fleet.children if "dynamo_worker" in " ".join(c.cmdline())]
    assert len(workers) == 2
    workers[0].kill()
    for t in threads:
        t.join(240)
    assert all(r is not None for r in results), results
    expected = {p: reference(engine, engine.encode(p), 96) for p in PROMPTS}
    for i, r in enumerate(results):
        if r[0] == "done":
            assert r[2] in ("length", "stop"), r
            assert r[1] == expected[PROMPTS[i % 3]], (i, r)
        else:
            assert r[1].strip(), f"stream {i} ended with an empty error"
    after = fleet.chat([{"role": "user", "content": PROMPTS[0]}])
    assert after["choices"][0]["message"]["content"] == reference(engine, engine.encode(PROMPTS[0]))
    assert fleet.proc.poll() is None  # the fleet keeps serving on one worker


def test_ctrl_c_stops_every_process_of_the_fleet(fleet, build_dir):
    """Last: SIGINT to `trtdflash serve --dynamo` stops the frontend and every worker, and leaves no discovery files."""
    fleet.proc.send_signal(signal.SIGINT)
    assert fleet.proc.wait(60) == 0
    assert "stopping the Dynamo fleet gracefully" in fleet.proc.stderr.read()
    time.sleep(0.5)
    alive = [c for c in fleet.children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [c.cmdline() for c in alive]
    assert not (build_dir / ".dynamo").exists()
