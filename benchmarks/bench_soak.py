"""Soak: hundreds of mixed requests from many concurrent clients against the real batched server on loopback.
Backs: docs/performance.md#reliability-under-load (2,000 requests from 32 clients: 0 errors, memory +1.8 %).
Reproduce: python benchmarks/bench_soak.py --requests 2000 --concurrency 32.

Streaming and not, different lengths, one in eight clients leaving mid-stream. Afterwards every request either
completed with the text it gets alone (greedy), or left with a prefix of it, or got an error (expected: none); the
server still answers health checks; and its memory (server + model stubs) is back near where it started.

    python benchmarks/bench_soak.py --requests 300 --concurrency 32                 # the default build's dtype
    python benchmarks/bench_soak.py --requests 300 --concurrency 32 --dtype fp32
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trtllm_dflash.clients.loadgen import soak
from trtllm_dflash.config import DTYPE_CHOICES
from trtllm_dflash.cpu import machine_info, resolve_dtype
from trtllm_dflash.data import gsm8k_records
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.serving.serve import ServerConfig, TritonServer

CHAT = [
    "How do I make a good cup of coffee at home?",
    "Why do leaves change color in autumn?",
    "Give me three ideas for a rainy-day activity with kids.",
    "What is the difference between weather and climate?",
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 24, 48])
    ap.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="the build's (auto: as `trtdflash build` chooses)"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = ap.parse_args(argv)

    held_out = gsm8k_records(holdout=True)
    prompts = [r["question"] for r in held_out[-4:]] + CHAT
    with tempfile.TemporaryDirectory() as tmp:
        build = run_build(
            BuildOptions(
                output=Path(tmp) / "build",
                target=args.target,
                max_batch_size=args.max_batch_size,
                max_seq_len=512,
                dtype=args.dtype,
            ),
            progress=lambda m: None,
        )
        with TritonServer(ServerConfig(build, grpc_port=0, http_port=0, metrics_port=0)) as server:
            report = soak(server, prompts, args.requests, args.concurrency, tuple(args.lengths))
    result = {
        "benchmark": "bench_soak",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "target": args.target,
        "max_batch_size": args.max_batch_size,
        "dtype": resolve_dtype(args.dtype),
        **report,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
