"""`trtdflash quickstart`: build the embedded default, serve it with the real tritonserver, stream one answer, then
time DFlash against the same build without a draft on three chat, three math and three code prompts.

The two builds differ only in the draft (same target, dtype, batch and sequence limits). Both are served at once, each
gets the same untimed warm-up request first, and every prompt runs on one server and then the other, the order
alternating from one prompt to the next: a drift of the machine's speed (a busy neighbour, a slower minute on a VM)
lands on both columns instead of on whichever build ran second. A kind's row pools its prompts (tokens over seconds,
as a user sending all three would see) and gives the range of their speed-ups beside it: one prompt alone says more
about that prompt than about its kind (docs/performance.md#quickstart-prompts). A first look, not a benchmark (that is
`benchmarks/bench_serving.py`).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from trtllm_dflash.clients.client import Completion, CompletionRequest, complete
from trtllm_dflash.cpu import cpu_model, resolve_dtype
from trtllm_dflash.data import CODE_COMPLETE_TEMPLATE, gsm8k_records
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.gguf4 import takes_four_bit
from trtllm_dflash.resolve import cache_dir
from trtllm_dflash.serving.serve import ServerConfig, TritonServer, stop_all

KINDS = ("chat", "math", "code")
CHAT_QUESTIONS = (
    "What are three simple habits that help people sleep better?",
    "How do I keep a basil plant healthy on a windowsill?",
    "What is a simple way to plan a week of dinners?",
)
CODE_STUBS = (
    '''def running_max(values: list[int]) -> list[int]:
    """Return a list whose i-th element is the largest of values[0..i].
    >>> running_max([1, 3, 2, 5, 4])
    [1, 3, 3, 5, 5]
    """
''',
    '''def second_largest(values: list[int]) -> int:
    """Return the second largest distinct value in values.
    >>> second_largest([4, 1, 7, 7, 3])
    4
    """
''',
    '''def chunk(items: list[int], size: int) -> list[list[int]]:
    """Split items into consecutive lists of length size; the last one may be shorter.
    >>> chunk([1, 2, 3, 4, 5], 2)
    [[1, 2], [3, 4], [5]]
    """
''',
)


def demo_prompts() -> list[tuple[str, str]]:
    """(kind, prompt): three of each kind, none in the draft's training data (math: the first three held-out GSM8K
    questions), the kinds taking turns as a server's mixed traffic would."""
    math = [r["question"] for r in gsm8k_records(holdout=True)[:3]]
    code = [CODE_COMPLETE_TEMPLATE.format(code=stub) for stub in CODE_STUBS]
    return [(kind, text) for texts in zip(CHAT_QUESTIONS, math, code) for kind, text in zip(KINDS, texts)]


def streamed_prompt(prompts: list[tuple[str, str]] | None = None) -> str:
    """The prompt the quickstart streams unless given one: the first code prompt (of `prompts`, default
    `demo_prompts()`), where the draft's blocks are long enough to watch."""
    return next(text for kind, text in (prompts or demo_prompts()) if kind == "code")


def _pooled(runs: list[Completion]) -> float:
    seconds = sum(c.wall_time for c in runs)
    return sum(c.num_tokens for c in runs) / seconds if seconds > 0 else 0.0


@dataclass
class Comparison:
    """One prompt kind's greedy runs on both servers: dflash[i] and baseline[i] answered prompts[i]."""

    kind: str
    prompts: list[str]
    dflash: list[Completion]
    baseline: list[Completion]

    @property
    def dflash_tokens_per_second(self) -> float:
        return _pooled(self.dflash)

    @property
    def baseline_tokens_per_second(self) -> float:
        return _pooled(self.baseline)

    @property
    def speedup(self) -> float:
        base = self.baseline_tokens_per_second
        return self.dflash_tokens_per_second / base if base else 0.0

    @property
    def prompt_speedups(self) -> list[float]:
        """Each prompt's speed-up (its rounds pooled), in the order the prompts first ran."""
        out = []
        for p in dict.fromkeys(self.prompts):
            d = [c for q, c in zip(self.prompts, self.dflash) if q == p]
            b = _pooled([c for q, c in zip(self.prompts, self.baseline) if q == p])
            out.append(_pooled(d) / b if b else 0.0)
        return out

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target forward over all the kind's DFlash runs (each run's forwards recovered from
        its acceptance length, which is its tokens after the first over its forwards)."""
        steps = sum(round((c.num_tokens - 1) / c.acceptance_length) for c in self.dflash if c.acceptance_length > 0)
        return sum(c.num_tokens - 1 for c in self.dflash if c.acceptance_length > 0) / steps if steps else 0.0


@dataclass
class QuickstartResult:
    build: Path
    dtype: str
    rounds: int = 0
    rows: list[Comparison] = field(default_factory=list)


def _serve(build: Path) -> TritonServer:
    return TritonServer(ServerConfig(build, grpc_port=0, http_port=0, metrics_port=0))


def _warm_up(url: str, prompt: str) -> None:
    complete(url, CompletionRequest(prompt, 8))  # the first request pays one-off setup: not timed


def run_quickstart(
    output: Path | None = None,
    draft: str | None = None,
    prompt: str | None = None,
    max_tokens: int = 96,
    dtype: str = "auto",
    compare: bool = True,
    say: Callable[[str], None] = print,
    on_text: Callable[[str], None] = print,
    rounds: int = 1,
) -> QuickstartResult:
    """Build (or reuse) the DFlash repository, serve it and stream `prompt` (default: `streamed_prompt()`) through
    `on_text`; with `compare`, also build the same repository without a draft (in `<output>-no-draft`), serve both and
    time them on `demo_prompts()`, each `rounds` times."""
    if rounds < 1:
        raise DFlashError(f"--rounds must be at least 1, got {rounds}.")
    out = Path(output) if output else cache_dir() / "quickstart"
    dtype = resolve_dtype(dtype)
    result = QuickstartResult(
        run_build(BuildOptions(output=out, draft=draft, dtype=dtype), progress=say), dtype, rounds
    )
    prompts = demo_prompts()
    prompt = prompt or streamed_prompt(prompts)
    with ExitStack() as stack:
        say("Starting tritonserver (free loopback ports)...")
        server = stack.enter_context(_serve(result.build))
        say("Ready.\n" + server.endpoints())
        say(f"\n$ trtdflash client --url {server.grpc_url} --prompt {shlex.quote(prompt)} --max-tokens {max_tokens}")
        done = complete(server.grpc_url, CompletionRequest(prompt, max_tokens), on_text=on_text)
        on_text("\n")
        say(done.summary())
        if not compare:
            say("Stopping tritonserver...")
            return result
        baseline_dir = out.with_name(out.name + "-no-draft")
        say(f"\nThe same build without a draft, for comparison ({baseline_dir})...")
        baseline_build = run_build(BuildOptions(output=baseline_dir, no_draft=True, dtype=dtype), progress=say)
        baseline = stack.enter_context(_serve(baseline_build))
        urls = {"dflash": server.grpc_url, "baseline": baseline.grpc_url}
        for url in urls.values():
            _warm_up(url, prompts[0][1])
        _warm_up(urls["baseline"], prompt)  # so both servers hold the streamed prompt in their prefix cache
        rows = {kind: Comparison(kind, [], [], []) for kind in KINDS}
        say(
            f"Timing both on {len(prompts)} prompts ({', '.join(KINDS)} taking turns), {max_tokens} tokens each, "
            f"{rounds} round{'s' if rounds > 1 else ''} (one server then the other, the order alternating)..."
        )
        for i, (kind, text) in enumerate(prompts * rounds):
            done = {
                build: complete(urls[build], CompletionRequest(text, max_tokens))
                for build in (("dflash", "baseline") if i % 2 == 0 else ("baseline", "dflash"))
            }
            rows[kind].prompts.append(text)
            rows[kind].dflash.append(done["dflash"])
            rows[kind].baseline.append(done["baseline"])
        say("Stopping both servers...")
        stop_all([server, baseline])
    result.rows = list(rows.values())
    return result


def comparison_table(result: QuickstartResult) -> str:
    """Tokens/s with and without the draft, the speed-up, the range of the kind's prompts' speed-ups, acceptance
    length, and whether every run's greedy text is the same on both servers (always in fp32; in bf16 a near-tie may
    flip a token between the builds)."""
    n = len(result.rows[0].prompts) // result.rounds if result.rows else 0
    runs = f"{n} prompts a kind" + ("" if result.rounds == 1 else f" x {result.rounds} rounds")
    four_bit = takes_four_bit(result.build / "checkpoints" / "target", result.dtype, "auto")
    weights = ", the target's 4-bit weights as shipped" if four_bit else ""
    lines = [
        f"DFlash vs the same server without a draft ({result.dtype}{weights}, batch 1, greedy, {runs}, {cpu_model()}):",
        "",
        f"{'prompt':<8}{'DFlash tok/s':>14}{'no draft tok/s':>16}{'speed-up':>10}{'per prompt':>14}{'acceptance':>12}"
        "  same text",
        "-" * 84,
    ]
    for r in result.rows:
        same = (
            "yes"
            if all(d.text == b.text for d, b in zip(r.dflash, r.baseline))
            else "no (bf16 near-tie)"
            if result.dtype == "bf16"
            else "NO"
        )
        spread = r.prompt_speedups
        lines.append(
            f"{r.kind:<8}{r.dflash_tokens_per_second:>14.1f}{r.baseline_tokens_per_second:>16.1f}"
            f"{r.speedup:>9.2f}x{f'{min(spread):.2f}-{max(spread):.2f}x':>14}{r.acceptance_length:>12.2f}  {same}"
        )
    lines += [
        "",
        "tok/s: a kind's tokens over its seconds; per prompt: the slowest and fastest prompt's speed-up;",
        "acceptance: tokens committed per target forward (1.00: the draft never helped).",
        'Next: `trtdflash chat` talks turn by turn and `trtdflash generate "..."` answers once, without a server;',
        "`trtdflash build --output out/` then `trtdflash serve out/` serves your own build; deploying on GPUs with",
        "TensorRT-LLM: README.md; every measured figure: docs/performance.md.",
    ]
    return "\n".join(lines)
