"""`trtdflash quickstart`: build the embedded default, serve it with the real tritonserver, stream one answer, then
time DFlash against the same build without a draft on one chat, one math and one code prompt.

The two builds differ only in the draft (same target, dtype, batch and sequence limits). Each is served in turn and
gets the same untimed warm-up request first, so the table compares decoding and nothing else. One greedy run per
prompt: a first look, not a benchmark (that is `benchmarks/bench_serving.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .build import BuildOptions, run_build
from .client import Completion, CompletionRequest, complete
from .cpu import cpu_model, resolve_dtype
from .data import CODE_COMPLETE_TEMPLATE, gsm8k_records
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
    kind: str
    dflash: Completion
    baseline: Completion

    @property
    def speedup(self) -> float:
        return self.dflash.tokens_per_second / self.baseline.tokens_per_second if self.baseline.tokens_per_second else 0.0


@dataclass
class QuickstartResult:
    build: Path
    dtype: str
    rows: list[Comparison] = field(default_factory=list)


def _serve(build: Path) -> TritonServer:
    return TritonServer(ServerConfig(build, grpc_port=0, http_port=0, metrics_port=0))


def _time_prompts(url: str, prompts: list[tuple[str, str]], max_tokens: int) -> list[Completion]:
    complete(url, CompletionRequest(prompts[0][1], 8))  # warm-up, not timed
    return [complete(url, CompletionRequest(p, max_tokens)) for _, p in prompts]


def run_quickstart(output: Path | None = None, draft: str | None = None, prompt: str = "Explain speculative decoding in two sentences.",
                   max_tokens: int = 96, dtype: str = "auto", compare: bool = True, say: Callable[[str], None] = print,
                   on_text: Callable[[str], None] = print) -> QuickstartResult:
    """Build (or reuse) the DFlash repository, serve it and stream `prompt` through `on_text`; with `compare`, time it
    on `demo_prompts()`, then build and time the same repository without a draft (in `<output>-no-draft`)."""
    out = Path(output) if output else cache_dir() / "quickstart"
    dtype = resolve_dtype(dtype)
    result = QuickstartResult(run_build(BuildOptions(output=out, draft=draft, dtype=dtype), progress=say), dtype)
    prompts = demo_prompts()
    say("Starting tritonserver (free loopback ports)...")
    with _serve(result.build) as server:
        say("Ready.\n" + server.endpoints())
        say(f"\n$ trtdflash client --url {server.grpc_url} --prompt {prompt!r} --max-tokens {max_tokens}")
        done = complete(server.grpc_url, CompletionRequest(prompt, max_tokens), on_text=on_text)
        on_text("\n")
        say(done.summary())
        if not compare:
            say("Stopping tritonserver...")
            return result
        say(f"\nTiming DFlash on a {', a '.join(k for k, _ in prompts)} prompt, {max_tokens} tokens each...")
        dflash = _time_prompts(server.grpc_url, prompts, max_tokens)
        say("Stopping tritonserver...")
    baseline_dir = out.with_name(out.name + "-no-draft")
    say(f"\nThe same build without a draft, for comparison ({baseline_dir})...")
    baseline_build = run_build(BuildOptions(output=baseline_dir, no_draft=True, dtype=dtype), progress=say)
    with _serve(baseline_build) as server:
        say("Timing it on the same prompts...")
        baseline = _time_prompts(server.grpc_url, prompts, max_tokens)
        say("Stopping tritonserver...")
    result.rows = [Comparison(kind, d, b) for (kind, _), d, b in zip(prompts, dflash, baseline)]
    return result


def comparison_table(result: QuickstartResult) -> str:
    """Tokens/s with and without the draft, the speed-up, acceptance length, and whether the greedy text matches
    (always in fp32; in bf16 a near-tie may flip a token)."""
    lines = [f"DFlash vs the same server without a draft ({result.dtype}, batch 1, greedy, one run each, {cpu_model()}):", "",
             f"{'prompt':<8}{'DFlash tok/s':>14}{'no draft tok/s':>16}{'speed-up':>10}{'acceptance':>12}  same text",
             "-" * 70]
    for r in result.rows:
        same = "yes" if r.dflash.text == r.baseline.text else "no (bf16 near-tie)" if result.dtype == "bf16" else "NO"
        lines.append(f"{r.kind:<8}{r.dflash.tokens_per_second:>14.1f}{r.baseline.tokens_per_second:>16.1f}"
                     f"{r.speedup:>9.2f}x{r.dflash.acceptance_length:>12.2f}  {same}")
    lines += ["", "acceptance: tokens committed per target forward (1.00: the draft never helped).",
              "Next: `trtdflash generate --prompt ...` decodes without a server; `trtdflash build --output out/` then",
              "`trtdflash serve out/` serves your own build; deploying on GPUs with TensorRT-LLM and all measured figures: README.md."]
    return "\n".join(lines)
