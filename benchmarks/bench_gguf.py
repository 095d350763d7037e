"""The shipped GGUF decoded side by side: our engine on its 4-bit weights (plain and DFlash), on bf16 weights (plain
and DFlash), and llama.cpp on the same file (`llama-cpp-python`, plain and with prompt lookup), batch 1, greedy, the
same prompt token ids. Backs: docs/performance.md#q4-kernel (our 4-bit decode against llama.cpp's and the bytes-per-
token limit). Reproduce: python benchmarks/bench_gguf.py --rounds 3 --output benchmarks/results/gguf-<cpu>-<date>.json.

Each configuration answers every prompt (held-out GSM8K questions and everyday questions through the chat template,
`--max-new-tokens` each) once per round, the configurations taking turns within a round, after one warm-up answer
each; a configuration's figure is the median over rounds of its tokens over its decoding seconds (prefill excluded
for both engines: ours counts from the first token, llama.cpp's from its own prompt-eval end). Beside them, the limit
memory sets on plain decoding: the bytes a token streams (every linear's weights as multiplied, the LM head's)
over the bandwidth a large copy measures here.

Needs `pip install llama-cpp-python==0.3.16` (it builds llama.cpp for this CPU, minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads

configure_threads()  # before torch loads: the threads `trtdflash generate` runs with


def prompts(n: int) -> list[str]:
    """n prompts: held-out GSM8K questions alternating with everyday ones (loadgen.default_prompts)."""
    from trtllm_dflash.clients.loadgen import default_prompts

    return default_prompts((n + 1) // 2)[:n]


def bandwidth_gb_s() -> float:
    """A large copy's bytes (read and written) per second, best of five: what streaming weights can reach here."""
    import torch

    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MB, far beyond the caches
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def streamed_bytes(engine) -> int:
    """The bytes one plain decode step reads: every linear's weights as it multiplies them, and the LM head's."""
    from trtllm_dflash.kernels.packed import PackedLinear

    total = 0
    for m in engine.target.model.modules():
        if isinstance(m, PackedLinear):
            w = m.packed if m.packed is not None else m.weight
            total += w.numel() * w.element_size() + (m.scale.numel() * 4 if m.scale is not None else 0)
    head = engine.target.lm_head
    if not isinstance(head, PackedLinear):
        total += head.weight.numel() * head.weight.element_size()
    return total


def ours(engine, ids: list[int], max_new: int) -> tuple[int, float]:
    """(tokens, decoding seconds from the first token on) of one greedy answer."""
    t0, first, n = time.perf_counter(), None, 0
    for new, _ in engine.stream(ids, max_new_tokens=max_new):
        first = first or time.perf_counter()
        n += len(new)
    return n, time.perf_counter() - (first or t0)


def llama(llm, ids: list[int], max_new: int) -> tuple[int, float]:
    """(tokens, decoding seconds) of one greedy llama.cpp answer: its own eval timings, prompt excluded."""
    llm.reset()
    n = 0
    t0, first = time.perf_counter(), None
    for _ in llm.create_completion(ids, max_tokens=max_new, temperature=0.0, top_k=1, stream=True):
        first = first or time.perf_counter()
        n += 1
    return n, time.perf_counter() - (first or t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp's prompt lookup: tokens it guesses")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()

    import torch
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from trtllm_dflash.cpuinfo import cpu_model, isa_summary
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.models.gguf4 import GGUF_FILE
    from trtllm_dflash.resolve import resolve_target

    gguf = str(resolve_target("smollm2-135m", print) / GGUF_FILE)
    quiet = lambda m: None  # noqa: E731
    engines = {
        "ours 4-bit DFlash": DFlashEngine.load("smollm2-135m", dtype="bf16", progress=quiet),
        "ours bf16 DFlash": DFlashEngine.load("smollm2-135m", dtype="bf16", weights="bf16", progress=quiet),
    }
    engines["ours 4-bit plain"] = DFlashEngine(engines["ours 4-bit DFlash"].target, None, 1)
    engines["ours bf16 plain"] = DFlashEngine(engines["ours bf16 DFlash"].target, None, 1)
    threads = torch.get_num_threads()  # what configure_threads gave our engine
    llamas = {
        "llama.cpp plain": Llama(gguf, n_ctx=2048, n_threads=threads, verbose=False),
        "llama.cpp lookup": Llama(
            gguf,
            n_ctx=2048,
            n_threads=threads,
            verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=a.lookup_tokens),
        ),
    }
    texts = prompts(a.prompts)
    ids = [engines["ours 4-bit plain"].encode(t) for t in texts]
    runs = {name: lambda i, e=e: ours(e, ids[i], a.max_new_tokens) for name, e in engines.items()}
    runs |= {name: lambda i, m=m: llama(m, ids[i], a.max_new_tokens) for name, m in llamas.items()}
    for run in runs.values():
        run(0)  # warm-up
    rounds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(a.rounds):
        done = {name: [0, 0.0] for name in runs}
        for i in range(len(ids)):
            for name, run in runs.items():
                n, s = run(i)
                done[name][0] += n
                done[name][1] += s
        for name, (n, s) in done.items():
            rounds[name].append(n / s)
        print(f"round {r + 1}: " + ", ".join(f"{name} {v[-1]:.1f}" for name, v in rounds.items()), flush=True)
    gb_s = bandwidth_gb_s()
    limit = {
        name: gb_s * 1e9 / streamed_bytes(engines[f"ours {name} plain"]) for name in ("4-bit", "bf16")
    }  # tokens/s plain decoding could reach were it bound by memory alone
    tok_s = {name: statistics.median(v) for name, v in rounds.items()}
    fastest = max(("llama.cpp plain", "llama.cpp lookup"), key=tok_s.get)
    report = {
        "benchmark": "bench_gguf.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "isa": isa_summary(),
        "threads": threads,
        "prompts": len(texts),
        "max_new_tokens": a.max_new_tokens,
        "rounds": rounds,
        "tokens_per_s": tok_s,
        "bandwidth_gb_s": gb_s,
        "streamed_mb_per_token": {n: streamed_bytes(engines[f"ours {n} plain"]) / 1e6 for n in ("4-bit", "bf16")},
        "plain_limit_tokens_per_s": limit,
        "ratios": {
            "ours 4-bit plain / llama.cpp plain": tok_s["ours 4-bit plain"] / tok_s["llama.cpp plain"],
            f"ours 4-bit DFlash / {fastest}": tok_s["ours 4-bit DFlash"] / tok_s[fastest],
            "ours 4-bit plain / ours bf16 plain": tok_s["ours 4-bit plain"] / tok_s["ours bf16 plain"],
            "ours 4-bit DFlash / ours bf16 DFlash": tok_s["ours 4-bit DFlash"] / tok_s["ours bf16 DFlash"],
        },
    }
    for name, v in tok_s.items():
        print(f"{name:<20} {v:7.1f} tok/s")
    for name, v in report["ratios"].items():
        print(f"{name}: {v:.2f}x")
    print(f"bandwidth {gb_s:.1f} GB/s; plain-decode limit " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in limit.items()))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
