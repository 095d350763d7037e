"""Every benchmark script starts: its imports resolve and its options parse (`--help`) with what the README's test
command installs, so a renamed function or a moved module breaks a test here rather than the next measurement."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))


def test_benchmarks_found():
    assert len(BENCHMARKS) >= 20, [p.name for p in BENCHMARKS]


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_starts(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
