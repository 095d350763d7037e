"""--dtype auto: bf16 where the CPU multiplies bf16 in hardware and oneDNN packs it, or where our bf16 kernel's AVX2
variant runs; fp32 elsewhere."""

import json
import os
import subprocess
import sys

from trtllm_dflash.cpu import BF16_HARDWARE_FLAGS, cpu_flags, cpu_model, fastest_dtype
from trtllm_dflash.deploy import BuildOptions, make_plan

GENERATE = [
    sys.executable,
    "-m",
    "trtllm_dflash.cli",
    "generate",
    "--no-draft",
    "--prompt",
    "hi",
    "--max-new-tokens",
    "2",
    "--json",
]


def _generate_dtype(env_extra: dict) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    out = subprocess.run(GENERATE, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["dtype"]


def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_arithmetic_or_avx2_alone():
    import torch

    assert cpu_model() != "unknown"
    avx2_alone = (
        torch.backends.cpu.get_cpu_capability() == "AVX2" and {"avx2", "fma"} <= cpu_flags()
    )  # our kernel's AVX2 variant
    expected = "bf16" if cpu_flags() & set(BF16_HARDWARE_FLAGS) or avx2_alone else "fp32"
    assert fastest_dtype() == expected
    assert _generate_dtype({}) == expected


def test_under_the_avx2_emulation_auto_is_bf16_with_our_kernel_and_fp32_without():
    """Held to AVX2, oneDNN cannot pack bf16 weights: bf16 runs fast only on our kernel's AVX2 variant (bf16_gemm.py),
    so auto picks bf16 where that kernel runs and fp32 where it is turned off."""
    import torch

    avx2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    with_kernel = "bf16" if {"avx2", "fma"} <= cpu_flags() else "fp32"
    if torch.backends.cpu.get_cpu_capability() != "AVX2":  # else the test above ran this very case, natively
        assert _generate_dtype(avx2) == with_kernel
    assert _generate_dtype(avx2 | {"TRTDFLASH_BF16_KERNEL": "off"}) == "fp32"


def test_a_build_records_the_dtype_auto_chose(tmp_path, random_draft_dir):
    plan = make_plan(
        BuildOptions(output=tmp_path / "b", draft=str(random_draft_dir), max_seq_len=64), progress=lambda m: None
    )
    assert plan.options.dtype == fastest_dtype()
