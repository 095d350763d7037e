"""What each GPU offers a deployment plan: memory, architecture and which low-precision formats run natively.

Memory is the spec-sheet capacity in decimal gigabytes (10^9 bytes). The driver reports a little more
(an "80 GB" H100 shows 81559 MiB = 85.5e9 bytes), so plans made with these numbers err on the safe side.
Sources: NVIDIA product pages and datasheets (H100 SXM 80 GB, H200 141 GB, DGX B200 1440 GB / 8 = 180 GB,
DGX B300 2.3 TB / 8 = 288 GB, GB200 NVL72 13.4 TB / 72 = 186 GB, L40S 48 GB, A100 80 GB); formats from
the TensorRT-LLM support matrix (FP8 from SM89, NVFP4 and MXFP4-weights x MXFP8-activations on SM100/SM103;
gpt-oss MXFP4 experts run weight-only W4A16 through the TRITON MoE backend on Hopper).

Bandwidth and tensor-core peaks (dense, no sparsity) are the datasheets' per-GPU figures (A100 SXM 80 GB, L40S,
H100 SXM, H200 SXM, DGX B200 / GB200 NVL72 / HGX B300 divided per GPU); they price a step for the draft-length
planner (deploy/schedule.py) and nothing else, and a GPU host replaces them with measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtllm_dflash.errors import DFlashError

GB = 10**9


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model; `sm` is the CUDA compute capability times ten."""

    name: str
    memory_bytes: int
    architecture: str  # ampere | ada | hopper | blackwell
    sm: int
    fp8: bool  # FP8 (E4M3) tensor cores: FP8 weights and FP8 KV cache
    nvfp4: bool  # NVFP4 tensor cores: NVFP4 weights and NVFP4 KV cache
    mxfp4_mxfp8: bool  # MXFP4 weights x MXFP8 activations natively (gpt-oss MoE on Blackwell)
    hbm_bytes_per_s: float = 0.0  # memory bandwidth
    tflops: tuple[tuple[str, float], ...] = ()  # dense tensor-core peak per operand format: bf16, fp8, fp4

    def peak_flops(self, fmt: str) -> float:
        """FLOP/s of `fmt` (bf16 | fp8 | fp4); a format without tensor cores runs at the next wider one's."""
        peaks = dict(self.tflops)
        for f in ("fp4", "fp8", "bf16")[("fp4", "fp8", "bf16").index(fmt) :]:
            if f in peaks:
                return peaks[f] * 1e12
        raise DFlashError(f"GPU {self.name} has no tensor-core peak on record.")

    @property
    def mxfp4_weight_only(self) -> bool:
        """MXFP4 experts dequantized in the kernel (W4A16, TRITON MoE); Hopper and newer."""
        return self.sm >= 90


# fmt: off
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        #       name     memory    architecture sm  FP8   NVFP4  MXFP4xMXFP8  HBM B/s   dense TFLOP/s per format
        GPUSpec("a100",  80 * GB,  "ampere",    80, False, False, False, 2.039e12, (("bf16", 312),)),
        GPUSpec("l40s",  48 * GB,  "ada",       89, True,  False, False, 0.864e12, (("bf16", 362), ("fp8", 733))),
        GPUSpec("h100",  80 * GB,  "hopper",    90, True,  False, False, 3.35e12,  (("bf16", 989), ("fp8", 1979))),
        GPUSpec("h200",  141 * GB, "hopper",    90, True,  False, False, 4.8e12,   (("bf16", 989), ("fp8", 1979))),
        GPUSpec("b200",  180 * GB, "blackwell", 100, True, True,  True,  8e12, (("bf16", 2250), ("fp8", 4500), ("fp4", 9000))),
        GPUSpec("gb200", 186 * GB, "blackwell", 100, True, True,  True,  8e12, (("bf16", 2500), ("fp8", 5000), ("fp4", 10000))),
        GPUSpec("b300",  288 * GB, "blackwell", 103, True, True,  True,  8e12, (("bf16", 2250), ("fp8", 4500), ("fp4", 13500))),
    )
}
# fmt: on


def gpu_spec(name: str) -> GPUSpec:
    """The GPU called `name` (case-insensitive)."""
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise DFlashError(f"Unknown GPU {name!r}; known GPUs: {', '.join(sorted(GPUS))}.")
    return spec
