"""What each GPU offers a deployment plan: memory, architecture and which low-precision formats run natively.

Memory is the spec-sheet capacity in decimal gigabytes (10^9 bytes). The driver reports a little more
(an "80 GB" H100 shows 81559 MiB = 85.5e9 bytes), so plans made with these numbers err on the safe side.
Sources: NVIDIA product pages and datasheets (H100 SXM 80 GB, H200 141 GB, DGX B200 1440 GB / 8 = 180 GB,
DGX B300 2.3 TB / 8 = 288 GB, GB200 NVL72 13.4 TB / 72 = 186 GB, L40S 48 GB, A100 80 GB); formats from
the TensorRT-LLM support matrix (FP8 from SM89, NVFP4 and MXFP4-weights x MXFP8-activations on SM100/SM103;
gpt-oss MXFP4 experts run weight-only W4A16 through the TRITON MoE backend on Hopper).
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

    @property
    def mxfp4_weight_only(self) -> bool:
        """MXFP4 experts dequantized in the kernel (W4A16, TRITON MoE); Hopper and newer."""
        return self.sm >= 90


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("a100", 80 * GB, "ampere", 80, fp8=False, nvfp4=False, mxfp4_mxfp8=False),
        GPUSpec("l40s", 48 * GB, "ada", 89, fp8=True, nvfp4=False, mxfp4_mxfp8=False),
        GPUSpec("h100", 80 * GB, "hopper", 90, fp8=True, nvfp4=False, mxfp4_mxfp8=False),
        GPUSpec("h200", 141 * GB, "hopper", 90, fp8=True, nvfp4=False, mxfp4_mxfp8=False),
        GPUSpec("b200", 180 * GB, "blackwell", 100, fp8=True, nvfp4=True, mxfp4_mxfp8=True),
        GPUSpec("gb200", 186 * GB, "blackwell", 100, fp8=True, nvfp4=True, mxfp4_mxfp8=True),
        GPUSpec("b300", 288 * GB, "blackwell", 103, fp8=True, nvfp4=True, mxfp4_mxfp8=True),
    )
}


def gpu_spec(name: str) -> GPUSpec:
    """The GPU called `name` (case-insensitive)."""
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise DFlashError(f"Unknown GPU {name!r}; known GPUs: {', '.join(sorted(GPUS))}.")
    return spec
