"""Which configuration serves each build fastest on this CPU, so that DFlash's speed-up is quoted against the fastest
draft-free one: the quickstart's DFlash and draft-free builds (bf16), each served natively and with torch, oneDNN and
our kernels held to the less this CPU could be (`--isa`: avx512, AVX-512 BF16 without AMX's tiles, as an AMD Zen 4;
avx2, as a CPU with AVX2 alone), every server up at once and the quickstart's nine prompts sent to each in turn, the
order alternating from one prompt to the next. A kind's figure pools its runs (tokens over seconds), as the
quickstart's table does.
Backs: docs/performance.md#xeon-amx (batch 1 served: DFlash at its fastest over the draft-free build at its fastest,
chat 1.17x, math 2.38x, code 2.20x). Reproduce: python benchmarks/bench_baselines.py --isa native avx512 avx2
--rounds 2.

Why: on a 2-core Xeon with AMX (2026-11-29) the draft-free server decoded about a tenth faster held off AMX (our
kernel's AVX-512 variant) than natively, while DFlash was fastest natively; the quickstart compares the two builds in
one configuration, so there its speed-up was larger than against the fastest draft-free server.

    python benchmarks/bench_baselines.py --isa native avx512 --rounds 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench_step_cost import ISA_ENV, runnable_isas  # noqa: E402  (native, avx512 held off AMX, avx2)

BUILDS = ("dflash", "no draft")


def cpu_ticks() -> list[int]:
    """/proc/stat's cpu line: the share of steal (the hypervisor's) over a run says whether its timings are clean."""
    return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


@contextmanager
def environment(extra: dict[str, str]):
    """os.environ with `extra` while a server starts (it copies the environment then)."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", nargs="+", default=["native", "avx512", "avx2"], choices=list(ISA_ENV))
    ap.add_argument("--rounds", type=int, default=2, help="runs of every prompt on every server")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--builds", default=None, help="directory for the two builds (default: <cache>/bench-baselines)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "baselines-smollm2-135m.json"))
    args = ap.parse_args(argv)

    from trtllm_dflash.clients.client import CompletionRequest, complete
    from trtllm_dflash.clients.quickstart import KINDS, demo_prompts
    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.deploy import BuildOptions, run_build
    from trtllm_dflash.resolve import cache_dir
    from trtllm_dflash.serving.serve import ServerConfig, TritonServer

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    isas = runnable_isas(args.isa)
    root = Path(args.builds) if args.builds else cache_dir() / "bench-baselines"
    builds = {
        "dflash": run_build(BuildOptions(output=root / "dflash", dtype="bf16"), progress=say),
        "no draft": run_build(BuildOptions(output=root / "no-draft", no_draft=True, dtype="bf16"), progress=say),
    }
    prompts = demo_prompts()
    keys = [(b, i) for i in isas for b in BUILDS]
    totals = {k: {kind: [0, 0.0] for kind in KINDS} for k in keys}  # tokens, seconds
    with ExitStack() as stack:
        urls = {}
        for build, isa in keys:
            say(f"serving {build}, {isa}...")
            with environment(ISA_ENV[isa]):
                urls[build, isa] = stack.enter_context(
                    TritonServer(ServerConfig(builds[build], grpc_port=0, http_port=0, metrics_port=0))
                ).grpc_url
        for url in urls.values():
            complete(url, CompletionRequest(prompts[0][1], 8))  # one-off setup, not timed
        ticks = cpu_ticks()
        say(f"timing {len(keys)} servers on {len(prompts)} prompts, {args.rounds} rounds...")
        for i, (kind, text) in enumerate(prompts * args.rounds):
            for key in keys if i % 2 == 0 else keys[::-1]:
                c = complete(urls[key], CompletionRequest(text, args.max_tokens))
                totals[key][kind][0] += c.num_tokens
                totals[key][kind][1] += c.wall_time
        delta = [b - a for a, b in zip(ticks, cpu_ticks())]
    speed = {k: {kind: n / s for kind, (n, s) in v.items()} for k, v in totals.items()}
    best = {(b, kind): max(isas, key=lambda i: speed[b, i][kind]) for b in BUILDS for kind in KINDS}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "steal_percent": round(100 * delta[7] / max(sum(delta), 1), 2),
        "args": vars(args),
        "tokens_per_second": {f"{b} / {i}": {kind: round(v, 2) for kind, v in speed[b, i].items()} for b, i in keys},
        "speedup_fastest_vs_fastest": {
            kind: round(
                speed["dflash", best["dflash", kind]][kind] / speed["no draft", best["no draft", kind]][kind], 3
            )
            for kind in KINDS
        },
        "speedup_same_isa": {
            i: {kind: round(speed["dflash", i][kind] / speed["no draft", i][kind], 3) for kind in KINDS} for i in isas
        },
        "fastest": {f"{b} / {kind}": best[b, kind] for b in BUILDS for kind in KINDS},
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"tokens/s, bf16, batch 1, greedy, {args.max_tokens} tokens, {args.rounds} rounds of 9 prompts (steal {report['steal_percent']} %):"
    )
    print(f"{'build / isa':<20}" + "".join(f"{k:>9}" for k in KINDS))
    for b, i in keys:
        print(f"{b + ' / ' + i:<20}" + "".join(f"{speed[b, i][k]:>9.1f}" for k in KINDS))
    for i in isas:
        print(f"{'speed-up, ' + i:<20}" + "".join(f"{report['speedup_same_isa'][i][k]:>8.2f}x" for k in KINDS))
    print(f"{'fastest / fastest':<20}" + "".join(f"{report['speedup_fastest_vs_fastest'][k]:>8.2f}x" for k in KINDS))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
