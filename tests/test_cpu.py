"""--dtype auto: bf16 only where the CPU multiplies bf16 in hardware and oneDNN packs it, fp32 elsewhere."""

import json
import os
import subprocess
import sys

from trtllm_dflash.build import BuildOptions, make_plan
from trtllm_dflash.cpu import BF16_HARDWARE_FLAGS, cpu_flags, cpu_model, fastest_dtype

GENERATE = [sys.executable, "-m", "trtllm_dflash.cli", "generate", "--no-draft", "--prompt", "hi", "--max-new-tokens", "2", "--json"]


def _generate_dtype(env_extra: dict) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    out = subprocess.run(GENERATE, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["dtype"]


def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_arithmetic():
    assert cpu_model() != "unknown"
    expected = "bf16" if cpu_flags() & set(BF16_HARDWARE_FLAGS) else "fp32"
    assert fastest_dtype() == expected
    assert _generate_dtype({}) == expected


def test_auto_is_fp32_when_onednn_is_held_to_avx2():
    """The AVX2-only emulation cannot pack bf16 weights, so bf16 would run emulated: auto must pick fp32."""
    assert _generate_dtype({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}) == "fp32"


def test_a_build_records_the_dtype_auto_chose(tmp_path, random_draft_dir):
    plan = make_plan(BuildOptions(output=tmp_path / "b", draft=str(random_draft_dir), max_seq_len=64), progress=lambda m: None)
    assert plan.options.dtype == fastest_dtype()
