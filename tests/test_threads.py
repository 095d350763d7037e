"""The CLI sizes torch's OpenMP pool from the CPUs it may use and lets waiting threads spin only briefly (threads.py)."""

import os
import subprocess
import sys

import pytest

from trtllm_dflash.threads import SPIN_COUNT, WIDE_ENV, WIDE_TOKENS, cgroup_cpus, server_threads, widened

CHILD = """
import os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # as `taskset -c 0` or a one-CPU cpuset would
from trtllm_dflash.cli import main
try:
    main(["generate", "--help"])
except SystemExit:
    pass
import torch
print(torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], os.environ.get("GOMP_SPINCOUNT", "-"), os.environ.get("OMP_WAIT_POLICY", "-"))
"""


def run(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env={**base, **env}, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[-4:]


def test_the_cli_sets_threads_from_the_affinity_mask_and_a_short_spin_before_torch_loads():
    assert run() == ["1", "1", SPIN_COUNT, "-"]


def test_the_users_settings_win():
    assert run(OMP_NUM_THREADS="2", OMP_WAIT_POLICY="ACTIVE") == [
        "2",
        "2",
        "-",
        "ACTIVE",
    ]  # no spin count over their policy
    assert run(GOMP_SPINCOUNT="0") == ["1", "1", "0", "-"]


@pytest.mark.parametrize(
    "files, cpus",
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # cgroup v2, docker --cpus 1.5
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_a_container_cpu_quota_caps_the_threads(tmp_path, files, cpus):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert cgroup_cpus(tmp_path) == cpus


SERVER_CHILD = """
from trtllm_dflash.cli import main
try:
    main(["serve", "--help"])
except SystemExit:
    pass
from trtllm_dflash.threads import WIDE_ENV, server_thread_env
env = server_thread_env()
print(env.get("OMP_NUM_THREADS", "theirs"), env.get(WIDE_ENV, "-"))
"""


def test_the_server_leaves_one_cpu_to_tritons_own_processes_but_for_prefills_unless_the_user_chose():
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", WIDE_ENV)
    }
    cpus = len(os.sched_getaffinity(0))
    every = min(cpus, cgroup_cpus() or cpus)
    narrow = max(1, every - 1)
    wide = str(every) if every > narrow else "-"  # prefills on every CPU, where that is more than a step gets
    for env, want in (({}, [str(narrow), wide]), ({"OMP_NUM_THREADS": "2"}, ["theirs", "-"])):
        r = subprocess.run(
            [sys.executable, "-c", SERVER_CHILD], capture_output=True, text=True, env={**base, **env}, timeout=120
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-2:] == want


@pytest.mark.parametrize(
    "env, want",
    [
        ({"OMP_NUM_THREADS": "1", WIDE_ENV: "2"}, (1, 2)),
        ({"OMP_NUM_THREADS": "1"}, None),  # not a server's model process
        ({WIDE_ENV: "2"}, None),
        ({"OMP_NUM_THREADS": "1", WIDE_ENV: "zero"}, None),
    ],
)
def test_a_model_process_reads_its_threads_for_steps_and_prefills(monkeypatch, env, want):
    for key in ("OMP_NUM_THREADS", WIDE_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert server_threads() == want


def test_a_long_prompt_chunk_runs_wide_and_the_step_count_returns():
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with widened((1, 2), WIDE_TOKENS):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with widened((1, 2), WIDE_TOKENS - 1):  # a short chunk: a step's count
            assert torch.get_num_threads() == 1
        with widened(None, 500):  # not a server: torch's count
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
