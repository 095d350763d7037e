"""CPU threads that share the machine: slow down in proportion to the cores a neighbour takes, not many times over.

torch's CPU wheels run OpenMP (GNU libgomp) with one thread per core and threads that spin while they wait.
Beside another busy process every parallel region then waits for a thread the kernel has descheduled while its
siblings burn the neighbour's time spinning, and a run takes many times longer
(docs/performance.md#threads-contention). So: one thread per CPU this process may run on (its affinity mask, which
`taskset` and cpusets narrow, or a container's CPU quota, not the machine's core count), and a short spin before a
waiting thread sleeps (SPIN_COUNT).

The wait is a trade: sleeping at once makes every parallel region wake a halted CPU, and libgomp's own long spin
burns a neighbour's time; a short spin is nearly as fast alone and slows beside a busy neighbour by about its fair
share (docs/performance.md#threads-spin-count). A spin count, not a policy, so one the user set wins either way
(libgomp takes GOMP_SPINCOUNT over OMP_WAIT_POLICY).

libgomp reads these variables once, when torch loads it, so they must be in the environment before the first
`import torch`: `trtdflash` sets them first thing (cli.main), and `serve` passes them, one CPU fewer
(server_thread_env), to tritonserver, whose python backend stubs (the Triton models, where torch runs) inherit its
environment. Values the user set win.
A program using the Python API calls `configure_threads()` itself, before its first `import torch`.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path

SPIN_COUNT = "3000"  # libgomp spins this many times before a waiting thread sleeps: see the module docstring
WIDE_ENV = "TRTDFLASH_PREFILL_THREADS"  # a server's model process: threads for a prompt's prefill (server_thread_env)
WIDE_TOKENS = 16  # a prompt chunk of at least this many tokens takes WIDE_ENV's threads: see server_thread_env


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """CPUs a container's CPU quota grants (`docker --cpus 2` sets a quota, not an affinity mask), rounded up; None
    without a quota. cgroup v2 (cpu.max), else v1 (cpu/cpu.cfs_quota_us)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota, period = ((root / "cpu" / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def thread_defaults(reserve: int = 0) -> dict[str, str]:
    """OpenMP settings: threads = CPUs in the affinity mask (or the cgroup quota, if smaller), less `reserve`, at least
    one; a short spin before waiting threads sleep, unless the user set a wait policy. (MKL follows OMP_NUM_THREADS,
    and torch sizes its pool from MKL's count, so MKL_NUM_THREADS is left alone: a value of its own would override
    the user's OMP_NUM_THREADS.)"""
    cpus = len(os.sched_getaffinity(0))
    threads = {"OMP_NUM_THREADS": str(max(1, min(cpus, cgroup_cpus() or cpus) - reserve))}
    if "OMP_WAIT_POLICY" in os.environ:  # the user chose how threads wait
        return threads
    return threads | {"GOMP_SPINCOUNT": SPIN_COUNT}


_DEFAULTED: set[str] = set()  # what configure_threads put into os.environ: ours to change, unlike the user's values


def configure_threads() -> None:
    """Put the defaults into this process's environment (before torch is imported); the user's own values stay."""
    for key, value in thread_defaults().items():
        if key not in os.environ:
            os.environ[key] = value
            _DEFAULTED.add(key)


def server_thread_env() -> dict[str, str]:
    """The settings tritonserver's model processes get: one CPU fewer than a lone process. Every step streams a
    response through the ensemble (the Python stubs of pre/postprocessing, the server's gRPC threads, the client), and
    an OpenMP pool on every core waits at each barrier for the thread that work preempted; vLLM's CPU backend
    likewise leaves a core to its frontend. On 2 cores one thread serves faster than two
    (docs/performance.md#threads-server-reserve). The user's own values win.

    A prompt's prefill (a chunk of WIDE_TOKENS tokens or more) is long enough that a preempted thread costs it little,
    so it runs on every CPU (WIDE_ENV, read by `server_threads`): there two threads beat one
    (docs/performance.md#threads-wide-prefill). Steps keep one CPU fewer: the policy prices a step from one cost
    curve, which a thread count that changes with a step's size would break (a 16-token step on two threads is
    cheaper than a 15-token one on one)."""
    env = {k: v for k, v in thread_defaults(reserve=1).items() if k not in os.environ or k in _DEFAULTED}
    wide = thread_defaults()["OMP_NUM_THREADS"]
    if "OMP_NUM_THREADS" in env and wide != env["OMP_NUM_THREADS"] and WIDE_ENV not in os.environ:
        env[WIDE_ENV] = wide
    return env


def worker_cpu_shares(workers: int) -> list[list[int]]:
    """The CPUs of this process's affinity mask split between `workers` processes of one fleet: contiguous shares as
    even as they go, every worker at least one CPU (more workers than CPUs share them round-robin)."""
    cpus = sorted(os.sched_getaffinity(0))
    if workers >= len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(workers)]
    size, extra = divmod(len(cpus), workers)
    shares, start = [], 0
    for i in range(workers):
        end = start + size + (i < extra)
        shares.append(cpus[start:end])
        start = end
    return shares


def worker_thread_env(cpus: int) -> dict[str, str]:
    """A fleet worker's settings on its share of `cpus` CPUs: the server's rule (server_thread_env) on that share,
    steps on one CPU fewer and a prompt's prefill on all of them; the user's own values win."""
    env = {"OMP_NUM_THREADS": str(max(1, cpus - 1))}
    if cpus > 1:
        env[WIDE_ENV] = str(cpus)
    if "OMP_WAIT_POLICY" not in os.environ:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return {k: v for k, v in env.items() if k not in os.environ or k in _DEFAULTED}


def server_threads() -> tuple[int, int] | None:
    """(threads for a step, threads for a prompt's prefill) in a server's model process (server_thread_env); None
    elsewhere, where torch's own count serves every forward."""
    narrow, wide = os.environ.get("OMP_NUM_THREADS", ""), os.environ.get(WIDE_ENV, "")
    if not (narrow.isdigit() and wide.isdigit() and int(narrow) > 0 and int(wide) > 0):
        return None
    return int(narrow), int(wide)


@contextmanager
def widened(threads: tuple[int, int] | None, tokens: int):
    """Run a prompt chunk of `tokens` tokens on the wide count of `threads` (server_threads) if it is WIDE_TOKENS or
    more; the step count again after it."""
    if threads is None or tokens < WIDE_TOKENS:
        yield
        return
    import torch  # here, not at the top: this module runs before torch is first imported (configure_threads)

    torch.set_num_threads(threads[1])
    try:
        yield
    finally:
        torch.set_num_threads(threads[0])
