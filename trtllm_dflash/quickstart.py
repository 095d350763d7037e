"""`trtdflash quickstart`: build the embedded default, serve it with the real tritonserver, stream one answer, then
time DFlash against the same build without a draft on one chat, one math and one code prompt.

The two builds differ only in the draft (same target, dtype, batch and sequence limits). Both are served at once, each
gets the same untimed warm-up request first, and every prompt runs on one server and then the other, the order
alternating between rounds: a drift of the machine's speed (a busy neighbour, a slower minute on a VM) lands on both
columns instead of on whichever build ran second. Each figure is the median of `rounds` greedy runs: a first look,
not a benchmark (that is `benchmarks/bench_serving.py`).
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .build import BuildOptions, run_build
from .client import Completion, CompletionRequest, complete
from .cpu import cpu_model, resolve_dtype
from .data import CODE_COMPLETE_TEMPLATE, gsm8k_records
from .errors import DFlashError
from .resolve import cache_dir
from .serve import ServerConfig, TritonServer

CODE_STUB = '''def running_max(values: list[int]) -> list[int]:
    """Return a list whose i-th element is the largest of values[0..i].
    >>> running_max([1, 3, 2, 5, 4])
    [1, 3, 3, 5, 5]
    """
'''


def demo_prompts() -> list[tuple[str, str]]:
    """One prompt per kind, none of them in the draft's training data (math: the first held-out GSM8K question)."""
    return [("chat", "What are three simple habits that help people sleep better?"),
            ("math", gsm8k_records(holdout=True)[0]["question"]),
            ("code", CODE_COMPLETE_TEMPLATE.format(code=CODE_STUB))]


@dataclass
class Comparison:
    """One prompt's greedy runs on both servers, one per round."""
    kind: str
    dflash: list[Completion]
    baseline: list[Completion]

    @property
    def dflash_tokens_per_second(self) -> float:
        return statistics.median(c.tokens_per_second for c in self.dflash)

    @property
    def baseline_tokens_per_second(self) -> float:
        return statistics.median(c.tokens_per_second for c in self.baseline)

    @property
    def acceptance_length(self) -> float:
        """The median, like the speeds: an engine's policy learns from every request, so a prompt's first round may
        draft less than its later ones."""
        return statistics.median(c.acceptance_length for c in self.dflash)

    @property
    def speedup(self) -> float:
        base = self.baseline_tokens_per_second
        return self.dflash_tokens_per_second / base if base else 0.0


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


def run_quickstart(output: Path | None = None, draft: str | None = None, prompt: str = "Explain speculative decoding in two sentences.",
                   max_tokens: int = 96, dtype: str = "auto", compare: bool = True, say: Callable[[str], None] = print,
                   on_text: Callable[[str], None] = print, rounds: int = 3) -> QuickstartResult:
    """Build (or reuse) the DFlash repository, serve it and stream `prompt` through `on_text`; with `compare`, also
    build the same repository without a draft (in `<output>-no-draft`), serve both and time them on `demo_prompts()`."""
    if rounds < 1:
        raise DFlashError(f"--rounds must be at least 1, got {rounds}.")
    out = Path(output) if output else cache_dir() / "quickstart"
    dtype = resolve_dtype(dtype)
    result = QuickstartResult(run_build(BuildOptions(output=out, draft=draft, dtype=dtype), progress=say), dtype, rounds)
    prompts = demo_prompts()
    with ExitStack() as stack:
        say("Starting tritonserver (free loopback ports)...")
        server = stack.enter_context(_serve(result.build))
        say("Ready.\n" + server.endpoints())
        say(f"\n$ trtdflash client --url {server.grpc_url} --prompt {prompt!r} --max-tokens {max_tokens}")
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
        runs = {(kind, build): [] for kind, _ in prompts for build in urls}
        say(f"Timing both on a {', a '.join(k for k, _ in prompts)} prompt, {max_tokens} tokens each, {rounds} rounds "
            "(one server then the other, the order alternating)...")
        for r in range(rounds):
            for kind, text in prompts:
                for build in (("dflash", "baseline") if r % 2 == 0 else ("baseline", "dflash")):
                    runs[kind, build].append(complete(urls[build], CompletionRequest(text, max_tokens)))
        say("Stopping both servers...")
    result.rows = [Comparison(kind, runs[kind, "dflash"], runs[kind, "baseline"]) for kind, _ in prompts]
    return result


def comparison_table(result: QuickstartResult) -> str:
    """Tokens/s with and without the draft, the speed-up, acceptance length, and whether every run's greedy text is the
    same (always in fp32; in bf16 a near-tie may flip a token between the builds)."""
    runs = "one run each" if result.rounds == 1 else f"median of {result.rounds} interleaved runs"
    lines = [f"DFlash vs the same server without a draft ({result.dtype}, batch 1, greedy, {runs}, {cpu_model()}):", "",
             f"{'prompt':<8}{'DFlash tok/s':>14}{'no draft tok/s':>16}{'speed-up':>10}{'acceptance':>12}  same text",
             "-" * 70]
    for r in result.rows:
        d = r.dflash[0]
        same = "yes" if all(c.text == d.text for c in r.dflash + r.baseline) else "no (bf16 near-tie)" if result.dtype == "bf16" else "NO"
        lines.append(f"{r.kind:<8}{r.dflash_tokens_per_second:>14.1f}{r.baseline_tokens_per_second:>16.1f}"
                     f"{r.speedup:>9.2f}x{r.acceptance_length:>12.2f}  {same}")
    lines += ["", "acceptance: tokens committed per target forward (1.00: the draft never helped).",
              "Next: `trtdflash generate --prompt ...` decodes without a server; `trtdflash build --output out/` then",
              "`trtdflash serve out/` serves your own build; deploying on GPUs with TensorRT-LLM and all measured figures: README.md."]
    return "\n".join(lines)
