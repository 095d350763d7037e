"""`trtdflash bench --conditions`: the draft's acceptance under each condition a backend can vary, against the short,
cold, greedy baseline, where upstream has seen acceptance collapse without a word:

- long prompts (z-lab #66): each record behind about N tokens of unrelated text (GSM8K questions), per length;
- a warm prefix cache (vLLM #47930, z-lab #165): each of the first length's prompts sent again at once;
- sampling (z-lab #169): temperature 0.7, seeded per record;
- thinking (z-lab #133): the chat template's `enable_thinking` on and off, where the template has that switch.

CUDA-graph padding (TensorRT-LLM #16548) belongs to the GPU engine's batch shapes, not to a request: the Dynamo and
trtllm-serve launchers refuse releases without its fix (deploy/trtllm/schema.py DFLASH_FIXES).

Every run starts each record's first message with a fresh reference line, so that nothing but the chat template's
head is cached from earlier runs; the warm run resends earlier records, line and all, on purpose. A run is one user at a
time: the draft's acceptance, not the scheduler's draft length under load. A condition whose τ (SPEED-Bench's
Average_AL) falls below COLLAPSE of the baseline's is a collapse.

Streamed acceptance counts what each step committed, so it includes the server's own choice of draft length. A server
that adapts it per request from what earlier requests accepted (the embedded default, `--speculation adaptive`)
carries that state from one condition to the next; a fixed-length server (TensorRT-LLM's `draft_len_schedule`, an
embedded build with `--speculation fixed`) shows the draft's acceptance alone.
"""

from __future__ import annotations

import dataclasses
import statistics
import uuid
from collections.abc import Callable, Sequence

from trtllm_dflash.clients.datasets import Record
from trtllm_dflash.clients.loadgen import TurnOptions, run_records
from trtllm_dflash.clients.specbench import Conversation, acceptance, per_position
from trtllm_dflash.errors import DFlashError

COLLAPSE = 0.7  # a condition's τ under this share of the baseline's is reported as a collapse
LENGTHS = (1024, 4096)  # prompt tokens, about: SmolLM2's context is 8192
TEMPERATURE = 0.7
CHARS_PER_TOKEN = 4  # English text in a BPE vocabulary, about; a tokenizer counts exactly where given
BASELINE = "short, cold, greedy"
THINKING = "enable_thinking"
WARM = "#warm"  # marks a record's second sending


def _fresh(records: Sequence[Record]) -> list[Record]:
    """The records with a reference line of their own in front: no earlier run cached their prompts."""
    tag = uuid.uuid4().hex[:8]
    return [
        dataclasses.replace(r, turns=(f"(ref {tag}-{i})\n{r.turns[0]}", *r.turns[1:])) for i, r in enumerate(records)
    ]


def _interleave(a: Sequence[Record], b: Sequence[Record]) -> list[Record]:
    """a's records, each followed by b's at the same index where b has one."""
    return [r for i, x in enumerate(a) for r in (x, *b[i : i + 1])]


def filler(tokens: int, count: Callable[[str], int]) -> str:
    """About `tokens` tokens (by `count`) of GSM8K questions, one per line: text a request does not need."""
    from trtllm_dflash.data import gsm8k_records

    lines, text = [], ""
    for row in gsm8k_records():
        lines.append(row["question"])
        text = "\n".join(lines)
        if count(text) >= tokens:
            break
    return text


def padded(records: Sequence[Record], tokens: int, count: Callable[[str], int]) -> list[Record]:
    """Each record's first message behind about `tokens` tokens of filler, marked as such."""
    notes = filler(tokens, count)
    return [
        dataclasses.replace(r, turns=(f"Unrelated notes:\n{notes}\n\nNow my request.\n{r.turns[0]}", *r.turns[1:]))
        for r in records
    ]


def thinking_switch(url: str, render, records: Sequence[Record]) -> str | None:
    """None where the chat template renders `enable_thinking` on and off differently; else why thinking cannot be
    measured. With `render` (the tokenizer's template) the renders are compared; over OpenAI without one, the prompt
    tokens the server reports for a one-token answer each way."""
    from trtllm_dflash.clients.loadgen import _openai_turn

    messages = [{"role": "user", "content": records[0].turns[0]}]
    if render is not None:
        on, off = (render(messages, **{THINKING: flag}) for flag in (True, False))
    elif url.startswith(("http://", "https://")):
        on, off = (
            _openai_turn(url, messages, 1, 60.0, TurnOptions(template_kwargs={THINKING: flag}))[0].prompt_tokens
            for flag in (True, False)
        )
        if on is None:
            return "the server reports no prompt tokens, so the client cannot tell whether its template has the switch"
    else:
        return "over Triton's gRPC the client renders the template: give --tokenizer"
    return None if on != off else f"the chat template has no {THINKING} switch"


def summary(convs: Sequence[Conversation], errors: list[str], estimated: bool) -> dict:
    """A condition's row: τ, the conditional acceptance per position, the first turns' prompt and cached tokens where
    the server reports them, and errors."""
    a = acceptance(convs)
    prompts = [c.turns[0].prompt_tokens for c in convs if c.turns[0].prompt_tokens is not None]
    cached = [c.turns[0].cached_tokens for c in convs if c.turns[0].cached_tokens is not None]
    return {
        "tau": a["Average_AL"] if convs else None,
        "conditional": per_position(a["Acceptance_Length_Histogram"]),
        "records": len(convs),
        "prompt_tokens_median": statistics.median(prompts) if prompts else None,
        "cached_tokens_median": statistics.median(cached) if cached else None,
        "errors": errors,
        "chunk_tokens_estimated": estimated,
    }


def run_conditions(
    url: str,
    records: Sequence[Record],
    *,
    lengths: Sequence[int] = LENGTHS,
    temperature: float = TEMPERATURE,
    max_tokens: int = 128,
    render=None,
    count: Callable[[str], int] | None = None,
    progress=print,
) -> tuple[dict, list[Conversation]]:
    """Every condition on the server at `url`, one user at a time, then each τ against the baseline's: the report and
    the baseline's conversations (what its speculation profile is measured on).

    `render(messages, **template_kwargs) -> text` is the chat template (needed over Triton's gRPC for multi-turn
    records and thinking); `count(text) -> tokens` sizes the long prompts (characters / CHARS_PER_TOKEN without)."""
    count = count or (lambda text: len(text) // CHARS_PER_TOKEN)
    progress = progress or (lambda message: None)
    greedy = TurnOptions()
    runs: list[tuple[tuple[str, ...], list[Record], TurnOptions]] = [
        ((BASELINE,), _fresh(records), greedy),
        ((f"temperature {temperature:g}",), _fresh(records), TurnOptions(temperature, seed=0)),
    ]
    # The first length's records each twice in a row, the second time with its prompt cached whatever the cache's
    # budget: cold and warm on the same prompts. The cache keeps whole prefill chunks (prefix_cache.BLOCK), so a
    # long prompt is the one with most to hit.
    for i, n in enumerate(lengths):
        cold = _fresh(padded(records, n, count))
        again = [dataclasses.replace(r, question_id=r.question_id + WARM) for r in cold] if i == 0 else []
        runs.append(((f"prompt ~{n}",) + ((f"prompt ~{n}, warm",) if again else ()), _interleave(cold, again), greedy))
    skipped = {}
    if why := thinking_switch(url, render, records):
        skipped["thinking"] = why
    else:
        runs += [
            ((f"thinking {'on' if on else 'off'}",), _fresh(records), TurnOptions(template_kwargs={THINKING: on}))
            for on in (True, False)
        ]
    results: dict[str, dict] = {}
    measured: dict[str, list[Conversation]] = {}
    for names, recs, options in runs:
        convs, errors, estimated = run_records(url, recs, 1, max_tokens, render=render, options=options)
        for name in names:
            warm = name.endswith("warm")
            measured[name] = [c for c in convs if c.turns and c.question_id.endswith(WARM) == warm]
            mine = [e for e in errors if e.split(":", 1)[0].endswith(WARM) == warm]
            r = results[name] = summary(measured[name], mine, estimated)
            tau = f"τ {r['tau']:.2f}" if r["tau"] is not None else "no record answered"
            progress(f"{name}: {tau} over {r['records']} records" + (f", {len(mine)} errors" if mine else ""))
    judge(results)
    return {"url": url, "collapse_below": COLLAPSE, "results": results, "skipped": skipped}, measured[BASELINE]


def judge(results: dict[str, dict]) -> None:
    """Each row's τ as a share of the baseline's (`ratio`), and whether it collapsed (under COLLAPSE)."""
    base = results[BASELINE]["tau"]
    if base is None:
        raise DFlashError(f"The baseline run failed every record; the first: {results[BASELINE]['errors'][0]}")
    for r in results.values():
        r["ratio"] = r["tau"] / base if r["tau"] is not None else None
        r["collapsed"] = r["ratio"] is not None and r["ratio"] < COLLAPSE


def collapses(report: dict) -> list[str]:
    """One sentence per condition whose τ collapsed."""
    base = report["results"][BASELINE]["tau"]
    return [
        f"Acceptance collapses with {name}: τ {r['tau']:.2f} is {r['ratio']:.0%} of the {BASELINE} τ {base:.2f} "
        f"(below {report['collapse_below']:.0%})."
        for name, r in report["results"].items()
        if r["collapsed"]
    ]


def table(report: dict) -> str:
    """Condition, τ, share of the baseline, the first draft positions' conditional acceptance, and the first turns'
    prompt and cached tokens (medians, where the server reports them)."""
    number = lambda x: f"{x:.0f}" if x is not None else "-"  # noqa: E731
    head = f"{'condition':<20}{'tau':>6}{'vs base':>9}  {'p1..p4':<22}{'prompt':>8}{'cached':>8}"
    lines = [head, "-" * len(head)]
    for name, r in report["results"].items():
        if r["tau"] is None:
            lines.append(f"{name:<20}{'-':>6}{'-':>9}  not run: {r['errors'][0] if r['errors'] else 'no records'}")
            continue
        p = " ".join(f"{x:.2f}" for x in r["conditional"][:4])
        tokens = f"{number(r['prompt_tokens_median']):>8}{number(r['cached_tokens_median']):>8}"
        lines.append(
            f"{name:<24}{r['tau']:>6.2f}{r['ratio']:>8.0%}   {p:<22}{tokens}" + ("  COLLAPSE" * r["collapsed"])
        )
    lines += [f"{name}: not measured, {why}." for name, why in report["skipped"].items()]
    return "\n".join(lines)


def bench_conditions(
    url: str,
    records: Sequence[Record],
    *,
    dataset: str,
    lengths: Sequence[int] = LENGTHS,
    max_tokens: int = 128,
    tokenizer: str | None = None,
    output: str | None = None,
    progress=print,
) -> dict:
    """`bench --conditions`: run_conditions, and the speculation profile of the baseline (specbench.profile) with each
    condition's τ and conditional acceptance under `under`; with `output`, the report there and the profile beside it."""
    import datetime
    from pathlib import Path

    from trtllm_dflash.atomic import write_json
    from trtllm_dflash.clients.bench import renderer
    from trtllm_dflash.clients.specbench import PROFILE, profile
    from trtllm_dflash.cpu import cpu_model

    progress = progress or (lambda message: None)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    render, count = renderer(tokenizer), None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        count = lambda text: len(tok(text)["input_ids"])  # noqa: E731
    report, baseline = run_conditions(
        url, records, lengths=lengths, max_tokens=max_tokens, render=render, count=count, progress=progress
    )
    conditions = {
        "server": url,
        "dataset": dataset,
        "categories": sorted({r.category for r in records}),
        "records": len(records),
        "concurrency": 1,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "date": started,
        "machine": cpu_model(),
        "chunk_tokens_estimated": report["results"][BASELINE]["chunk_tokens_estimated"],
    }
    measured = profile(baseline, conditions)
    measured["under"] = {
        name: {k: r[k] for k in ("tau", "ratio", "conditional", "collapsed")}
        for name, r in report["results"].items()
        if name != BASELINE
    }
    report = (
        {
            "benchmark": "trtdflash bench --conditions",
            "dataset": dataset,
            "date": started,
            "client_cpu": conditions["machine"],
            "max_tokens": max_tokens,
            "lengths": list(lengths),
            "records": [r.question_id for r in records],
        }
        | report
        | {"profile": measured}
    )
    if output:
        out = Path(output)
        write_json(out, report)
        write_json(out.parent / PROFILE, measured)
        progress(f"wrote {out} and {out.parent / PROFILE}")
    return report
