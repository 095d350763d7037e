"""Peak memory of `trtdflash convert` on a target: the whole-model path against the layer-by-layer (disk offload) one.
Backs: docs/quantization.md#convert-peak-memory (Qwen2.5-Coder-1.5B to FP8: 2.84 GB layer by layer against 8.65 GB
whole). Reproduce: OMP_NUM_THREADS=1 python benchmarks/bench_convert_memory.py --model qwen2.5-coder-1.5b --quant fp8
--calib-samples 4.

Each path runs in its own fresh process (`trtdflash convert --no-offload` / `--offload`), one after the other, so
neither sees the other's allocations; its peak RSS is the kernel's `ru_maxrss` for that child (os.wait4), cross-checked
with the `peak_rss_mb` its quantization.json card records. Both outputs are compared tensor for tensor at the end.
Waits (up to --max-wait seconds) for the 1-minute load average to drop below --max-load: the machine is shared.
Writes benchmarks/results/convert-memory.json.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_convert_memory.py --model qwen2.5-coder-1.5b --quant fp8 --calib-samples 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trtllm_dflash.cpu import cpu_model, isa_summary

RESULTS = Path(__file__).parent / "results" / "convert-memory.json"
TRTDFLASH = Path(sys.executable).with_name("trtdflash")


def wait_for_quiet(max_load: float, max_wait: float) -> float:
    deadline = time.time() + max_wait
    while os.getloadavg()[0] >= max_load and time.time() < deadline:
        time.sleep(15)
    return os.getloadavg()[0]


def run(args, offload: bool, out: Path) -> dict:
    cmd = [
        str(TRTDFLASH),
        "convert",
        "--model",
        args.model,
        "--quant",
        args.quant,
        "--calib-data",
        args.calib_data,
        "--calib-samples",
        str(args.calib_samples),
        "--output",
        str(out),
        "--offload" if offload else "--no-offload",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    load = wait_for_quiet(args.max_load, args.max_wait)
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.time() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    card = json.loads((out / "quantization.json").read_text())
    return {
        "path": "layer-by-layer (disk offload)" if offload else "whole model",
        "offload": offload,
        "seconds": round(seconds, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "card_peak_rss_mb": card["peak_rss_mb"],
        "load_average_at_start": round(load, 2),
        "shards": sorted(p.name for p in out.glob("*.safetensors")),
    }


def same_tensors(a: Path, b: Path) -> bool:
    """One tensor of each side resident at a time: the outputs of a model larger than RAM need not fit either."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        found = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                found.update(dict.fromkeys(st.keys(), f))
        return found

    ia, ib = index(a), index(b)
    if sorted(ia) != sorted(ib):
        return False
    for name in ia:
        with safe_open(ia[name], framework="pt") as sa, safe_open(ib[name], framework="pt") as sb:
            x, y = sa.get_tensor(name), sb.get_tensor(name)
            if (
                x.dtype != y.dtype
                or x.shape != y.shape
                or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            ):
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--quant", default="fp8")
    ap.add_argument("--calib-data", default="chat")
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--max-wait", type=float, default=900)
    args = ap.parse_args()

    from trtllm_dflash.convert.core import _weight_files
    from trtllm_dflash.resolve import resolve_target

    source = resolve_target(args.model, progress=lambda m: None)
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=Path.home() / ".cache"))  # on disk, not a tmpfs
    try:
        runs = [run(args, offload, work / ("offload" if offload else "whole")) for offload in (False, True)]
        identical = same_tensors(work / "whole", work / "offload")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": {
            "cpu": cpu_model(),
            "isa": isa_summary(),
            "cores": os.cpu_count(),
            "ram_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": args.model,
        "source_weights_gb": round(sum(f.stat().st_size for f in _weight_files(source)) / 1e9, 2),
        "format": args.quant,
        "calibration": {"data": args.calib_data, "samples": args.calib_samples},
        "runs": runs,
        "identical_tensors": identical,
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_convert_memory.py " + " ".join(sys.argv[1:]),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
