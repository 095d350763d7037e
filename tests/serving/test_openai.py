"""The OpenAI-compatible frontend on the REAL tritonserver, driven by the official `openai` SDK.

One server per module (free loopback ports, always stopped). Greedy decoding is lossless, so what the
frontend returns must equal the plain `ensemble` on the same prompt text: for chat, the conversation
rendered with the build's tokenizer chat template. Block size 4 and short answers keep the CPU cost low.
"""

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from trtllm_dflash.clients.client import CompletionRequest, complete
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.resolve import resolve_draft
from trtllm_dflash.serving.serve import ServerConfig, TritonServer

pytestmark = pytest.mark.slow  # real servers (see pyproject.toml's markers)

MODEL = "smollm2-135m"
PROMPT = "The three primary colors are"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": [{"type": "text", "text": "Name three colors."}]},
]
MAX_TOKENS = 24  # the chat answer ends by itself before this
COMPLETION_TOKENS = 8  # the completion runs to this length
BLOCK = 4
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def build_dir(request, tmp_path_factory):
    """The packaged default draft once it has landed (the build's default), else a random one."""
    draft = None if resolve_draft(None, MODEL) else str(request.getfixturevalue("random_draft_dir"))
    return run_build(
        BuildOptions(
            output=tmp_path_factory.mktemp("openai") / "build",
            draft=draft,
            block_size=BLOCK,
            max_seq_len=MAX_SEQ_LEN,
            max_batch_size=2,
            speculation="fixed",
            dtype="fp32",
        ),
        progress=lambda m: None,
    )  # fixed: statistics comparable between calls


@pytest.fixture(scope="module")
def server(build_dir):
    """The frontend stops with the server: its port closes and its thread is gone."""
    s = TritonServer(ServerConfig(build_dir, grpc_port=0, http_port=0, metrics_port=0, openai_port=0)).start()
    try:
        yield s
    finally:
        s.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((s.host, s.openai_port), timeout=5).close()
    assert not [t for t in threading.enumerate() if t.name == "openai-frontend"]


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(build_dir):
    return AutoTokenizer.from_pretrained(build_dir / "tokenizer")


def _ensemble(server, prompt, max_tokens=MAX_TOKENS, **kw):
    """The plain ensemble, greedy, on text sent as is."""
    return complete(
        server.grpc_url, CompletionRequest(prompt, max_tokens, False, apply_chat_template=False, **kw), timeout=120
    )


@pytest.fixture(scope="module")
def completion_ref(server):
    return _ensemble(server, PROMPT, COMPLETION_TOKENS)


@pytest.fixture(scope="module")
def rendered(tokenizer):
    """MESSAGES through the build's chat template, text parts joined, as the frontend must render them."""
    turns = [
        {**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in MESSAGES
    ]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def chat_ref(server, rendered):
    return _ensemble(server, rendered)


def _reason(done):
    return "length" if done.finish_reason == "length" else "stop"


def _http(server, method, path, body: bytes | None = None):
    req = urllib.request.Request(
        server.openai_url.removesuffix("/v1") + path,
        data=body,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_models_health_and_unknown_model(server, api):
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert api.models.retrieve("ensemble").id == MODEL
    assert _http(server, "GET", "/health")[0] == 200
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]


def test_completion_equals_the_ensemble_with_usage(api, tokenizer, completion_ref):
    r = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=COMPLETION_TOKENS, temperature=0, n=1, presence_penalty=0, echo=False
    )
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    assert r.object == "text_completion" and r.choices[0].text == completion_ref.text
    assert r.choices[0].finish_reason == _reason(completion_ref)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens,
        completion_ref.num_tokens,
        prompt_tokens + completion_ref.num_tokens,
    )
    assert r.model_extra["dflash"] == {
        "acceptance_length": pytest.approx(completion_ref.acceptance_length, abs=1e-3),
        "drafted_tokens": completion_ref.drafted_tokens,
        "accepted_tokens": completion_ref.accepted_tokens,
    }


def test_completion_stream(api, completion_ref):
    chunks = list(
        api.completions.create(
            model="ensemble",
            prompt=PROMPT,
            max_tokens=COMPLETION_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) > 1 and "".join(texts) == completion_ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == _reason(completion_ref)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == completion_ref.num_tokens


def test_chat_renders_the_whole_conversation(api, tokenizer, rendered, chat_ref):
    r = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == chat_ref.text and r.choices[0].finish_reason == _reason(chat_ref)
    assert (
        r.usage.prompt_tokens == len(tokenizer(rendered)["input_ids"])
        and r.usage.completion_tokens == chat_ref.num_tokens
    )
    assert (
        r.usage.prompt_tokens_details.cached_tokens == 0
    )  # its own system message: no head, and under one whole chunk
    assert r.model_extra["dflash"]["drafted_tokens"] == chat_ref.drafted_tokens

    chunks = list(
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_ref.text
    assert (
        chunks[-1].choices[0].finish_reason == _reason(chat_ref)
        and chunks[-1].model_extra["dflash"]["accepted_tokens"] == chat_ref.accepted_tokens
    )
    assert all(c.usage is None for c in chunks), "usage is streamed only when asked for"


def test_chat_template_kwargs_reach_the_template_and_never_the_renderer(api, chat_ref):
    """vLLM's `chat_template_kwargs`: a variable the template does not read changes nothing; the renderer's own
    arguments (tokenize would hand the server token ids for text) are refused."""
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    r = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )
    assert r.choices[0].message.content == chat_ref.text
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"chat_template_kwargs": {"tokenize": True}}
        )
    assert e.value.body["param"] == "chat_template_kwargs" and "may not set 'tokenize'" in e.value.body["message"]


def test_prompts_behind_one_long_system_message_reuse_its_chunks(api, tokenizer):
    """The second request copies the whole 64-token chunks the two rendered prompts share (prefix_cache.py), says so in
    usage.prompt_tokens_details.cached_tokens, and answers as a server that computed them would (the first request's
    answer to the same question, asked again after the other)."""
    system = {"role": "system", "content": "You are the help desk of a small bakery on Willow Street. " * 12}
    asks = ["When do you open?", "Do you bake rye bread?"]
    rendered = [
        tokenizer.apply_chat_template(
            [system, {"role": "user", "content": a}], tokenize=False, add_generation_prompt=True
        )
        for a in asks
    ]
    ids = [tokenizer(t)["input_ids"] for t in rendered]
    common = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)
    assert common >= 128

    def ask(text):
        return api.chat.completions.create(
            model=MODEL, messages=[system, {"role": "user", "content": text}], max_tokens=12, temperature=0
        )

    first = ask(asks[0])
    second = ask(asks[1])
    assert second.usage.prompt_tokens_details.cached_tokens == common // 64 * 64
    again = ask(asks[0])
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids[0]) - 1) // 64 * 64  # all but its last chunk
    assert again.choices[0].message.content == first.choices[0].message.content


def test_one_user_turn_renders_like_the_ensembles_own_template(server, api):
    """The frontend's rendering and the preprocessing model's chat template give the same prompt."""
    r = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=4, temperature=0
    )
    served = complete(
        server.grpc_url, CompletionRequest("Name three colors.", 4, False, apply_chat_template=True), timeout=120
    )
    assert r.choices[0].message.content == served.text


def test_stop_strings(api, chat_ref):
    word = chat_ref.text.split()[2]  # stop at the third word
    r = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stop=[word, "never-seen"]
    )
    assert (
        r.choices[0].message.content == chat_ref.text[: chat_ref.text.index(word)]
        and r.choices[0].finish_reason == "stop"
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_unsupported_parameters_get_a_400_with_a_message(api, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param and "not supported" in e.value.body["message"]


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "not valid JSON"),
        (json.dumps({"prompt": PROMPT, "best_of": 3}).encode(), "best_of=3 is not supported"),
        (json.dumps({"prompt": PROMPT, "echo": True}).encode(), "echo=true is not supported"),
        (json.dumps({"prompt": PROMPT, "temperature": "hot"}).encode(), "'temperature' must be a number"),
        (json.dumps({"prompt": PROMPT, "max_tokens": 10**9}).encode(), "ask for 1 to"),
        (json.dumps({"prompt": "word " * 300}).encode(), "context window is 256"),
        (json.dumps({"prompt": [1, 2, 3]}).encode(), "'prompt' must be a string"),
        (json.dumps({"prompt": PROMPT, "top_p": 0}).encode(), "top_p"),
    ],
)
def test_bad_requests_get_openai_error_json_and_the_server_keeps_serving(server, api, body, message):
    status, text = _http(server, "POST", "/v1/completions", body)
    error = json.loads(text)["error"]
    assert status == 400 and message in error["message"] and error["type"] == "invalid_request_error", text
    assert _serves(api)


def _serves(api) -> bool:
    return api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0).usage.completion_tokens == 1


def test_two_concurrent_streams_both_complete(api, chat_ref):
    texts, errors = [None, None], []

    def run(i):
        try:
            stream = api.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            texts[i] = "".join(c.choices[0].delta.content or "" for c in stream)
        except Exception as e:  # collected, asserted below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and texts == [chat_ref.text] * 2


def test_disconnecting_client_cancels_its_request(server, api):
    cancelled = lambda: re.findall(r"request cancelled after (\d+) tokens", server.log_path.read_text(errors="replace"))  # noqa: E731
    before = len(cancelled())
    stream = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=MAX_SEQ_LEN - 64,
        temperature=0,
        stream=True,
    )
    assert next(iter(stream)).choices[0].finish_reason is None
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(cancelled()) == before:
        time.sleep(0.5)
    assert len(cancelled()) > before and int(cancelled()[-1]) < MAX_SEQ_LEN - 64
    assert _serves(api)


def test_bench_loads_the_frontend_as_it_would_a_peers(server, tmp_path):
    """`trtdflash bench` with an http:// URL drives the OpenAI API as vLLM's, SGLang's or trtllm-serve's: every
    request streams the tokens asked for (the final usage), and ours reports its acceptance beside them."""
    from trtllm_dflash.clients.bench import run_bench

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "Write a long story about a dragon who learns to bake bread.\nList every month of the year with one fact about each.\n"
    )
    report = run_bench(
        [f"http://{server.host}:{server.openai_port}"],
        [1, 2],
        prompts_file=str(prompts),
        max_tokens=8,
        requests=3,
        progress=None,
    )
    for level in next(iter(report["levels"].values())):
        assert level["completed"] == 3 and level["errors"] == [] and level["tokens"] == 3 * 8
        assert level["ttft_p50_s"] > 0 and level["steady_tokens_per_s"] > 0 and level["acceptance_length_median"] >= 1


def test_bench_runs_categorised_records_as_speed_bench_does_through_triton_and_openai(server, build_dir, tmp_path):
    """`bench --dataset`: records of two categories, some of two turns, on Triton's gRPC path (the conversation rendered
    with the build's tokenizer) and through this frontend (which reports usage with every chunk): every record runs all
    its turns, each chunk's tokens counted exactly, and the metrics come per category; `--dataset speed-bench` reads a
    parquet file in SPEED-Bench's schema through the CLI."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from trtllm_dflash.clients.bench import category_table, run_dataset
    from trtllm_dflash.clients.datasets import builtin_records, select

    records = select(builtin_records(), 6, ["math", "rag"])
    assert sum(r.multiturn for r in records) == 2
    urls = [f"grpc={server.grpc_url}", f"openai={server.openai_url}"]
    report = run_dataset(
        urls, [2], records, dataset="builtin", max_tokens=16, tokenizer=str(build_dir / "tokenizer"), progress=None
    )
    for name in ("grpc", "openai"):
        (level,) = report["levels"][name]
        assert not level["errors"] and not level["chunk_tokens_estimated"], level["errors"]
        assert set(level["acceptance"]["Request_AL"]) == {r.question_id for r in records}
        assert set(level["acceptance"]["Category_AL"]) == {"math", "rag"} and level["acceptance"]["Average_AL"] > 1
        hist = level["acceptance"]["Acceptance_Length_Histogram"]
        turns = sum(len(r.turns) for r in records)  # 8: each turn streams at least its first token
        assert sum(hist.values()) >= turns and level["timing"]["Number of Output Tokens"]["max"] <= 16
        assert level["timing"]["Output TPS"] > 0 and level["timing"]["TTFT Time"]["min"] > 0
    table = category_table(report)
    assert "math" in table and "rag" in table and "overall" in table and "shared out by characters" not in table

    data = tmp_path / "speed" / "qualitative" / "test.parquet"
    data.parent.mkdir(parents=True)
    rows = [
        {
            "question_id": f"q{i}",
            "category": c,
            "sub_category": "",
            "turns": [t],
            "source": "ours",
            "src_id": str(i),
            "difficulty": "",
            "multiturn": False,
        }
        for i, (c, t) in enumerate(
            [("math", "What is 12 times 12?"), ("qa", "Name a large ocean."), ("math", "What is 3 + 4?")]
        )
    ]
    pq.write_table(pa.Table.from_pylist(rows), data)
    args = [sys.executable, "-m", "trtllm_dflash.cli", "bench", "--url", f"ours={server.openai_url}"]
    args += ["--dataset", "speed-bench", "--data", str(tmp_path), "--num-requests", "2", "--concurrency", "1"]
    out = tmp_path / "results" / "sb.json"
    run = subprocess.run(
        args + ["--max-tokens", "12", "--output", str(out)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    assert "math" in run.stdout and "qa" in run.stdout and "overall" in run.stdout
    profile = json.loads((out.parent / "speculation_profile.json").read_text())  # what build --acceptance-profile reads
    assert profile["conditions"]["dataset"] == "speed-bench qualitative" and set(profile["categories"]) == {
        "math",
        "qa",
    }
    assert all(0 <= p <= 1 for p in profile["conditional"]) and profile["tau"] >= 1


def test_bench_conditions_measure_acceptance_where_it_may_collapse(server, build_dir, tmp_path):
    """`bench --conditions` through this frontend (the CLI) and over Triton's gRPC (the template rendered with the
    build's tokenizer): every condition runs against the short, cold, greedy baseline; a cold long prompt finds only
    the template's head cached and its warm resend finds all but the last chunk, with the same acceptance (the cache
    keeps the draft's features); a length past the context is reported as not run; SmolLM2's template has no thinking
    switch; --gate exits 1 exactly where a condition collapsed; the profile records every condition."""
    import subprocess
    import sys

    from trtllm_dflash.clients.conditions import BASELINE, bench_conditions
    from trtllm_dflash.clients.datasets import builtin_records, select
    from trtllm_dflash.engine.prefix_cache import BLOCK

    out = tmp_path / "conditions.json"
    args = [sys.executable, "-m", "trtllm_dflash.cli", "bench", "--url", server.openai_url, "--conditions", "--gate"]
    args += ["--num-requests", "3", "--lengths", "100,400", "--max-tokens", "12", "--output", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == [BASELINE, "temperature 0.7", "prompt ~100", "prompt ~100, warm", "prompt ~400"]
    assert results[BASELINE]["records"] == 3 and results[BASELINE]["tau"] >= 1
    cold, warm = results["prompt ~100"], results["prompt ~100, warm"]
    assert cold["prompt_tokens_median"] >= 100 and cold["cached_tokens_median"] < BLOCK
    assert warm["cached_tokens_median"] > warm["prompt_tokens_median"] - BLOCK and warm["tau"] == cold["tau"]
    assert results["prompt ~400"]["tau"] is None and "context window" in results["prompt ~400"]["errors"][0]
    assert "no enable_thinking switch" in report["skipped"]["thinking"]
    collapsed = [n for n, r in results.items() if r["collapsed"]]
    assert run.returncode == (1 if collapsed else 0), run.stderr
    assert ("Gate failed" in run.stderr) == bool(collapsed) and "not run" in run.stdout
    profile = json.loads((tmp_path / "speculation_profile.json").read_text())
    assert profile["tau"] == results[BASELINE]["tau"] and set(profile["under"]) == set(results) - {BASELINE}

    report = bench_conditions(
        server.grpc_url,
        select(builtin_records(), 2),
        dataset="builtin",
        lengths=(100,),
        max_tokens=8,
        tokenizer=str(build_dir / "tokenizer"),
        progress=None,
    )
    results = report["results"]
    assert results[BASELINE]["tau"] >= 1 and not any(r["errors"] for r in results.values())
    assert results["prompt ~100, warm"]["cached_tokens_median"] > results["prompt ~100"]["cached_tokens_median"]
    assert "no enable_thinking switch" in report["skipped"]["thinking"]
