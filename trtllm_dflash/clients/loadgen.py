"""Load against a running server: closed-loop clients (each sends its next request when the previous one ends) over
Triton's gRPC or an OpenAI-compatible HTTP API, streaming or not, some leaving mid-stream. One home for what `trtdflash bench`, the serving benchmark, the soak run
and the load test send, and for the latency figures they report.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import queue
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from trtllm_dflash.clients.client import CompletionRequest, EnsembleStream
from trtllm_dflash.config import SamplingParams
from trtllm_dflash.errors import DFlashError

EVERYDAY_QUESTIONS = (  # not from any training set
    "What are some good ways to stay focused while working from home?",
    "Can you explain what a black hole is in simple terms?",
    "Give me three ideas for a rainy-day activity with kids.",
    "How do I make a good cup of coffee at home?",
    "What is the difference between weather and climate?",
    "Suggest a short plan for learning to play the guitar.",
    "Why do leaves change color in autumn?",
    "What should I consider when adopting a dog?",
)


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    stream: bool = True
    leave_after: int | None = None  # the client disconnects after this many responses


@dataclass
class Outcome:
    job: int
    text: str = ""
    tokens: int = 0
    error: str = ""
    left: bool = False  # the client disconnected on purpose
    ttft: float = 0.0
    latency: float = 0.0
    arrivals: list[tuple[float, int]] = field(
        default_factory=list
    )  # (perf_counter, tokens so far) per streamed response
    acceptance_length: float = 0.0

    @property
    def gaps(self) -> list[float]:
        """Seconds between streamed responses."""
        return [b[0] - a[0] for a, b in zip(self.arrivals, self.arrivals[1:])]

    def tokens_by(self, t: float) -> int:
        """Tokens this request had received at time t (perf_counter)."""
        return max((n for at, n in self.arrivals if at <= t), default=0)


@dataclass
class LoadRun:
    outcomes: list[Outcome]  # in job order
    wall: float  # seconds from the first request sent to the last response
    full: tuple[
        float, float
    ]  # (perf_counter) from every client's first token until the queue ran dry: all clients busy


def _error(e: Exception) -> str:
    return str(e) if isinstance(e, DFlashError) else f"{type(e).__name__}: {e}"


def _one(url: str, index: int, job: Job, timeout: float) -> Outcome:
    if url.startswith(("http://", "https://")):
        return _one_openai(url, index, job, timeout)
    out, responses = Outcome(index), queue.Queue()
    t0 = time.perf_counter()
    try:
        stream = EnsembleStream(
            url,
            CompletionRequest(job.prompt, job.max_tokens, job.stream),
            lambda result, error: responses.put((result, error)),
        )
    except Exception as e:  # noqa: BLE001 - a refused connection is an outcome like any other
        out.error = _error(e)
        return out
    try:
        while not stream.finished:
            try:
                piece = stream.read(*responses.get(timeout=timeout))
            except queue.Empty:
                out.error = f"no response within {timeout:.0f} s"
                break
            if piece:
                out.arrivals.append((time.perf_counter(), stream.done.num_tokens))
            if job.leave_after is not None and len(stream.done.pieces) >= job.leave_after and not stream.finished:
                out.left = True
                break
    except Exception as e:  # noqa: BLE001
        out.error = _error(e)
    finally:
        stream.close()
    done = stream.done
    out.text, out.tokens, out.acceptance_length = "".join(done.pieces), done.num_tokens, done.acceptance_length
    out.ttft, out.latency = done.time_to_first_token, time.perf_counter() - t0
    return out


def openai_base(url: str) -> str:
    """http://host:port or http://host:port/v1 (as vLLM, SGLang and trtllm-serve are given) -> the /v1 base."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


@functools.cache
def openai_model(url: str) -> str:
    """The first model the server lists: the one a single-model server (vLLM, SGLang, trtllm-serve, ours) serves."""
    try:
        with urllib.request.urlopen(openai_base(url) + "/models", timeout=30) as r:
            models = json.load(r).get("data") or []
    except (OSError, ValueError) as e:
        raise DFlashError(
            f"Cannot reach an OpenAI-compatible server at {url} ({getattr(e, 'reason', e)}); check the --url."
        ) from None
    if not models:
        raise DFlashError(f"The OpenAI-compatible server at {url} lists no model.")
    return models[0]["id"]


def _one_openai(url: str, index: int, job: Job, timeout: float) -> Outcome:
    """One chat completion through OpenAI's HTTP API, greedy, streamed as server-sent events unless `job.stream` is off.

    OpenAI's chunks carry text, not token counts: the final usage's completion tokens are shared out over the chunks
    by their characters, so the steady window's count is exact at its ends and close in between. The
    `acceptance_length` is the server's where it reports one (ours, in its `dflash` field), else the tokens per streamed
    chunk after the first: the tokens a forward commits, for servers that stream one chunk per forward (trtllm-serve,
    vLLM and SGLang do; a detokenizer holding back a partial character merges two, so it errs high).
    """
    out, t0 = Outcome(index), time.perf_counter()
    body = {
        "messages": [{"role": "user", "content": job.prompt}],
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "stream": job.stream,
    }
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    chars, pieces, usage = [], [], None
    try:
        body["model"] = openai_model(url)
        request = urllib.request.Request(
            openai_base(url) + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as r:
            if not job.stream:
                reply = json.load(r)
                pieces.append(reply["choices"][0]["message"]["content"] or "")
                out.ttft, usage = time.perf_counter() - t0, reply.get("usage")
                out.acceptance_length = float((reply.get("dflash") or {}).get("acceptance_length", 0.0))
                chars.append((time.perf_counter(), len(pieces[0])))
            for line in r if job.stream else ():
                data = line.decode("utf-8").strip()
                if not data.startswith("data:") or data[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(data[5:])
                if "error" in chunk:
                    raise DFlashError(
                        f"The server failed the request mid-stream: {chunk['error'].get('message', chunk['error'])}"
                    )
                usage = chunk.get("usage") or usage
                out.acceptance_length = float(
                    (chunk.get("dflash") or {}).get("acceptance_length", out.acceptance_length)
                )
                piece = (chunk["choices"][0].get("delta") or {}).get("content") if chunk.get("choices") else None
                if piece:
                    if not pieces:
                        out.ttft = time.perf_counter() - t0
                    pieces.append(piece)
                    chars.append((time.perf_counter(), sum(map(len, pieces))))
                    if job.leave_after is not None and len(pieces) >= job.leave_after:
                        out.left = True
                        break
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read()).get("error", {}).get("message", e.reason)
        except ValueError:
            reason = e.reason
        out.error = f"HTTP {e.code}: {reason}"
    except (OSError, ValueError, KeyError, IndexError, DFlashError) as e:
        out.error = _error(e)
    out.text, out.latency = "".join(pieces), time.perf_counter() - t0
    total = sum(map(len, pieces))
    out.tokens = int(usage["completion_tokens"]) if usage and not out.left else len(pieces)
    if not out.acceptance_length and job.stream and len(pieces) > 1 and not out.left:
        out.acceptance_length = (out.tokens - 1) / (len(pieces) - 1)
    out.arrivals = [(at, round(out.tokens * n / total) if total else 0) for at, n in chars]
    return out


def run_load(url: str, jobs: list[Job], concurrency: int, timeout: float = 600.0) -> LoadRun:
    """Run every job over `concurrency` clients."""
    return closed_loop(lambda i: _one(url, i, jobs[i], timeout), len(jobs), concurrency)


def closed_loop(send, requests: int, concurrency: int) -> LoadRun:
    """`send(i)` -> Outcome for i in 0..requests-1 over `concurrency` client threads, each taking the next request when
    its last one ends; the steady window from every first-wave client's first token until the queue ran dry."""
    todo, lock, outcomes, dry = list(range(requests)), threading.Lock(), [None] * requests, []

    def client():
        while True:
            with lock:
                if not todo:
                    dry.append(time.perf_counter())
                    return
                i = todo.pop(0)
            outcomes[i] = send(i)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    first_wave = [o for o in outcomes[:concurrency] if o.arrivals]
    return LoadRun(outcomes, wall, (max((o.arrivals[0][0] for o in first_wave), default=t0), min(dry)))


@dataclass(frozen=True)
class TurnOptions:
    """What every turn of a record run sends besides its messages: greedy by default, as SPEED-Bench runs; a seed
    per record where sampled (run_records adds the record's index); options for the chat template (vLLM's
    `chat_template_kwargs`, e.g. enable_thinking)."""

    temperature: float = 0.0
    seed: int | None = None
    template_kwargs: dict = field(default_factory=dict)


def _grpc_turn(url: str, messages: list[dict], max_tokens: int, render, timeout: float, options: TurnOptions):
    """One turn over Triton's gRPC stream: (Turn, answer). A first turn without template options is rendered by the
    build's chat template; any other, the whole conversation, by `render(messages, **template_kwargs)` (the chat
    template applied client-side) and sent as text."""
    from trtllm_dflash.clients.specbench import Turn

    sampling = SamplingParams(options.temperature, seed=options.seed)
    if len(messages) == 1 and not options.template_kwargs:
        request = CompletionRequest(messages[0]["content"], max_tokens, True, sampling)
    elif render is None:
        raise DFlashError(
            "A multi-turn record or chat-template options over Triton's gRPC need --tokenizer DIR (the build's "
            "tokenizer/) to render the conversation, or an OpenAI URL (http://HOST:PORT), whose server renders it."
        )
    else:
        text = render(messages, **options.template_kwargs)
        request = CompletionRequest(text, max_tokens, True, sampling, apply_chat_template=False)
    responses: queue.Queue = queue.Queue()
    turn = Turn(time.perf_counter())
    stream = EnsembleStream(url, request, lambda result, error: responses.put((result, error)))
    try:
        seen = 0
        while not stream.finished:
            try:
                stream.read(*responses.get(timeout=timeout))
            except queue.Empty:
                raise DFlashError(f"no response within {timeout:.0f} s") from None
            if stream.done.num_tokens > seen:  # a step's committed tokens (the empty final response adds none)
                turn.arrivals.append(time.perf_counter())
                turn.chunks.append(stream.done.num_tokens - seen)
                seen = stream.done.num_tokens
    finally:
        stream.close()
    turn.cached_tokens = stream.done.cached_tokens
    return turn, stream.done.text


def _openai_turn(url: str, messages: list[dict], max_tokens: int, timeout: float, options: TurnOptions):
    """One turn through an OpenAI chat API, streamed: (Turn, answer, whether the chunks' token counts are estimated).
    A chunk's tokens are exact where the server reports usage with every chunk (vLLM's and SGLang's
    `continuous_usage_stats`); elsewhere the final usage is shared out by characters."""
    from trtllm_dflash.clients.specbench import Turn

    body = {"model": openai_model(url), "messages": messages, "max_tokens": max_tokens}
    body |= {"temperature": options.temperature} | ({"seed": options.seed} if options.seed is not None else {})
    if options.template_kwargs:  # vLLM's and SGLang's extension, which our frontend takes too
        body["chat_template_kwargs"] = options.template_kwargs
    body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    request = urllib.request.Request(
        openai_base(url) + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    turn, pieces, counts, final = Turn(time.perf_counter()), [], [], None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            for line in r:
                data = line.decode("utf-8").strip()
                if not data.startswith("data:") or data[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(data[5:])
                if "error" in chunk:
                    raise DFlashError(chunk["error"].get("message", str(chunk["error"])))
                usage = chunk.get("usage") or {}
                final = usage.get("completion_tokens", final)
                turn.prompt_tokens = usage.get("prompt_tokens", turn.prompt_tokens)
                details = usage.get("prompt_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens", turn.cached_tokens)
                piece = (chunk["choices"][0].get("delta") or {}).get("content") if chunk.get("choices") else None
                if piece:
                    turn.arrivals.append(time.perf_counter())
                    pieces.append(piece)
                    counts.append(usage.get("completion_tokens"))
    except urllib.error.HTTPError as e:
        raise DFlashError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}") from None
    exact = bool(counts) and all(c is not None for c in counts)
    if exact:
        turn.chunks = [b - a for a, b in zip([0, *counts], counts)]
    else:
        total, chars = final or len(pieces), [len(p) for p in pieces]
        shares = [round(total * sum(chars[: i + 1]) / max(sum(chars), 1)) for i in range(len(chars))]
        turn.chunks = [b - a for a, b in zip([0, *shares], shares)]
    return turn, "".join(pieces), not exact


def run_records(
    url: str,
    records,
    concurrency: int,
    max_tokens: int,
    *,
    render=None,
    options: TurnOptions = TurnOptions(),
    timeout: float = 600.0,
):
    """SPEED-Bench's closed loop (specdec_bench run.py): one client slot per record for all its turns, each turn the
    user's message after the model's own answer to the last, greedy unless `options` say otherwise. Returns
    (Conversation per record, errors, whether any chunk's token count was estimated). `render(messages, **kwargs) ->
    text` is the chat template, for multi-turn records and template options over Triton's gRPC."""
    from trtllm_dflash.clients.specbench import Conversation

    convs = [Conversation(r.question_id, r.category) for r in records]
    errors: list[str] = []
    estimated = []

    def send(i: int) -> Outcome:
        messages, out = [], Outcome(i)
        mine = options if options.seed is None else dataclasses.replace(options, seed=options.seed + i)
        for text in records[i].turns:
            messages.append({"role": "user", "content": text})
            try:
                if url.startswith(("http://", "https://")):
                    turn, answer, guessed = _openai_turn(url, messages, max_tokens, timeout, mine)
                    estimated.append(guessed)
                else:
                    turn, answer = _grpc_turn(url, messages, max_tokens, render, timeout, mine)
            except (DFlashError, OSError, ValueError, KeyError, IndexError) as e:
                errors.append(f"{records[i].question_id}: {_error(e)}")
                out.error = _error(e)
                break
            convs[i].turns.append(turn)
            out.arrivals += [(t, 0) for t in turn.arrivals]
            messages.append({"role": "assistant", "content": answer})
        return out

    closed_loop(send, len(records), concurrency)
    return convs, errors, any(estimated)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else 0.0


def summary(run: LoadRun) -> dict:
    """Totals and p50/p99 latencies of the requests that completed (left and failed ones are counted apart).

    `steady_tokens_per_s` counts only the tokens streamed while every client had a request in flight: the whole
    run's figure also holds the ramp-up and the drain (the last requests finishing with ever fewer beside them),
    whose share depends on how many requests a level sends, not on the server.
    """
    outcomes, wall, (start, end) = run.outcomes, run.wall, run.full
    done = [o for o in outcomes if not o.error and not o.left]
    steady = (
        sum(o.tokens_by(end) - o.tokens_by(start) for o in outcomes if not o.error) / (end - start)
        if end > start
        else None
    )
    tokens = sum(o.tokens for o in done)
    tpot = [(o.latency - o.ttft) / max(o.tokens - 1, 1) for o in done]
    gaps = [g for o in done for g in o.gaps]
    pct = lambda xs, q: round(percentile(xs, q), 4)  # noqa: E731
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "left": sum(o.left for o in outcomes),
        "errors": [o.error for o in outcomes if o.error],
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "requests_per_s": round(len(done) / wall, 3) if wall else 0.0,
        "total_tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
        "steady_tokens_per_s": round(steady, 2) if steady is not None else None,
        "steady_s": round(max(end - start, 0.0), 3),
        "tokens_per_s_per_user": round(statistics.median(o.tokens / o.latency for o in done), 2) if done else 0.0,
        "ttft_p50_s": pct([o.ttft for o in done], 50),
        "ttft_p99_s": pct([o.ttft for o in done], 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "latency_p50_s": pct([o.latency for o in done], 50),
        "latency_p99_s": pct([o.latency for o in done], 99),
        "acceptance_length_median": round(statistics.median(o.acceptance_length for o in done), 3) if done else 0.0,
    }


def default_prompts(n_math: int = 16) -> list[str]:
    """The last `n_math` held-out GSM8K questions alternating with everyday questions: mixed traffic that no shipped
    draft trained on."""
    from trtllm_dflash.data import gsm8k_records

    held_out = gsm8k_records(holdout=True)
    math = [r["question"] for r in held_out[len(held_out) - n_math :]]
    return [p for pair in zip(math, EVERYDAY_QUESTIONS * (n_math // len(EVERYDAY_QUESTIONS) + 1)) for p in pair]


def median_level(rounds: list[dict]) -> dict:
    """The round with the median steady tokens/s (its latencies with it), and every round's figures."""
    ranked = sorted(rounds, key=lambda lv: lv["steady_tokens_per_s"] or 0.0)
    return ranked[(len(ranked) - 1) // 2] | {
        "steady_tokens_per_s_rounds": [lv["steady_tokens_per_s"] for lv in rounds],
        "total_tokens_per_s_rounds": [lv["total_tokens_per_s"] for lv in rounds],
    }


def check_levels(concurrency: list[int]) -> None:
    if not concurrency or min(concurrency) < 1:
        raise DFlashError(f"Concurrency levels must be positive numbers of clients, got {list(concurrency)}.")


def compare(urls: dict[str, str], prompts: list[str], concurrency: list[int], **options) -> dict[str, list[dict]]:
    """Every concurrency level on every server in turn, the order turning each round, so that a drift in the
    machine's speed falls on all of them; per server, one `summary` per level (the median round's). `options`: as
    `compare_rounds` takes them."""
    runs = compare_rounds(urls, prompts, concurrency, **options)
    return {name: [{"concurrency": c} | median_level(runs[name][c]) for c in concurrency] for name in urls}


def compare_rounds(
    urls: dict[str, str],
    prompts: list[str],
    concurrency: list[int],
    *,
    max_tokens: int,
    requests: int = 0,
    rounds: int = 1,
    progress=print,
) -> dict[str, dict[int, list[dict]]]:
    """`compare`'s rounds as they ran: per server and level, one `summary` a round (what median_level reduces).

    A level sends `requests` jobs (default: four per client, at least 8): with fewer than about four per client only
    the first part of a level has every client busy, and the steady figure needs that window.
    """
    if not prompts:
        raise DFlashError("No prompts to send.")
    check_levels(concurrency)
    if requests and requests <= max(concurrency):
        raise DFlashError(
            f"--requests ({requests}) must exceed the highest concurrency ({max(concurrency)}): the steady "
            "window starts once every client streams and ends when the queue runs dry."
        )
    for url in urls.values():  # one short request each: a wrong address fails here in one sentence, and it warms up
        probe = _one(url, 0, Job(prompts[0], 8), 600.0)
        if probe.error:
            raise DFlashError(probe.error)
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in concurrency} for name in urls}
    names = list(urls)
    for r in range(rounds):
        for c in concurrency:
            jobs = [Job(prompts[i % len(prompts)], max_tokens) for i in range(requests or max(8, 4 * c))]
            for name in names if r % 2 == 0 else names[::-1]:
                lv = summary(run_load(urls[name], jobs, c))
                runs[name][c].append(lv)
                if progress:
                    steady = lv["steady_tokens_per_s"]
                    progress(
                        f"round {r + 1} c={c:<3d} {name}: {steady if steady is not None else 0:.1f} tok/s steady, "
                        f"{lv['tokens_per_s_per_user']:.1f}/user, TTFT p50 {lv['ttft_p50_s']:.3f} s, "
                        f"acceptance {lv['acceptance_length_median']}, errors {len(lv['errors'])}"
                    )
    return runs


def plot_pareto(levels: dict[str, list[dict]], title: str, path: Path, interactivity=()) -> None:
    """Tokens/s per user against the server's steady tokens/s, one line per server, each point's concurrency on it;
    a dotted line at each `interactivity` target (tokens/s per user) the readout reads throughput at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, lvs) in enumerate(levels.items()):
        xs = [lv["steady_tokens_per_s"] or 0.0 for lv in lvs]
        ys = [lv["tokens_per_s_per_user"] for lv in lvs]
        ax.plot(
            xs, ys, marker="o^Dv"[i // 2 % 4], linestyle="--" if i % 2 else "-", label=name
        )  # pairs: a build and its baseline
        for lv, x, y in zip(lvs, xs, ys):
            ax.annotate(str(lv["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for target in interactivity:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{target:g} tok/s/user", (0, target), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    ax.set_xlabel("total output tokens/s (server, all clients busy)")
    ax.set_ylabel("output tokens/s per user (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (the server and its model stubs), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            rss = next(line for line in Path(f"/proc/{p}/status").read_text().splitlines() if line.startswith("VmRSS:"))
            total += int(rss.split()[1]) * 1024
        except (OSError, StopIteration):
            pass
        todo += children.get(p, [])
    return total


def mismatches(outcomes: list[Outcome], jobs: list[Job], references: dict[tuple[str, int], str]) -> list[str]:
    """Greedy outputs against each (prompt, max_tokens)'s text served alone: equal when completed, a prefix when the
    client left; one line per request that is neither (errors are reported by `summary`)."""
    bad = []
    for o in outcomes:
        job = jobs[o.job]
        ref = references[(job.prompt, job.max_tokens)]
        if not o.error and not (o.text == ref if not o.left else ref.startswith(o.text)):
            bad.append(f"request {o.job} ({'left' if o.left else 'completed'}): {o.text[:60]!r} vs {ref[:60]!r}")
    return bad


def mixed_jobs(prompts: list[str], n: int, lengths: tuple[int, ...], seed: int = 0) -> list[Job]:
    """n jobs cycling through prompts and lengths: a third not streamed, one in eight left after two responses."""
    import random

    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        stream = i % 3 != 0
        jobs.append(
            Job(
                prompts[i % len(prompts)],
                lengths[rng.randrange(len(lengths))],
                stream,
                leave_after=2 if stream and i % 8 == 1 else None,
            )
        )
    return jobs


def soak(server, prompts: list[str], n: int, concurrency: int, lengths: tuple[int, ...]) -> dict:
    """Warm up with every (prompt, length) alone (these are the references), then the mixed load; the report."""
    references = {}
    for p in prompts:
        for m in lengths:
            references[(p, m)] = run_load(server.grpc_url, [Job(p, m)], 1).outcomes[0].text
    rss_before = tree_rss_bytes(server.proc.pid)
    jobs = mixed_jobs(prompts, n, lengths)
    run = run_load(server.grpc_url, jobs, concurrency)
    time.sleep(2)  # let the last retirements land
    rss_after = tree_rss_bytes(server.proc.pid)
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    report = summary(run) | {
        "concurrency": concurrency,
        "mismatches": mismatches(run.outcomes, jobs, references),
        "healthy_after": bool(
            client.is_server_live() and client.is_server_ready() and client.is_model_ready("ensemble")
        ),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
    }
    client.close()
    return report
