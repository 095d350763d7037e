"""A Dynamo fleet on one machine: NVIDIA Dynamo's frontend (OpenAI API, KV router) and N DFlash workers of one build.

No etcd and no NATS: discovery is a folder of the build's (`--discovery-backend file`, removed when the fleet stops),
KV events travel over ZMQ (`--event-plane zmq`), requests over TCP. Every address Dynamo advertises is the fleet's
host (advertised_env), so nothing leaves 127.0.0.1 unless told to.

The machine's CPUs are split between the workers: each is pinned to its own share and runs the server's thread
rule on it (threads.worker_thread_env), so two workers on two cores do not preempt each other's OpenMP barriers.
The frontend migrates a stream cut by a dead worker to a live one (`--migration-limit`), so a fleet that loses a
worker keeps answering.

`Fleet` is a context manager; every process it starts is in a session of its own, is stopped by `stop()` (SIGTERM,
then SIGKILL after a grace period), and gets SIGTERM if the parent dies without stopping it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.config import ROUTER_MODES
from trtllm_dflash.deploy import read_build
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.serving.openai_server import model_id
from trtllm_dflash.serving.serve import check_ports, free_port, log_dir, stop_with_parent
from trtllm_dflash.threads import worker_cpu_shares, worker_thread_env

MIGRATION_LIMIT = 3  # times the frontend moves a stream whose worker died to another one


def system_port(host: str) -> int:
    """A free port for a worker's status server: Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit number, so below
    the ephemeral range that port 0 would pick from."""
    for _ in range(200):
        port = random.randrange(10000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise DFlashError(f"No free port in 10000..32767 on {host} for a worker's status server.")


def advertised_env(host: str) -> dict[str, str]:
    """Dynamo advertises the machine's own address for its planes unless these name one: the fleet's host (a
    wildcard host is no address to reach: then Dynamo's own choice stands)."""
    if host in ("0.0.0.0", "::", ""):
        return {}
    keys = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST")
    return dict.fromkeys(keys, host)


@dataclass(frozen=True)
class FleetConfig:
    """A fleet of `workers` replicas of the embedded build at `build_dir`; port 0 picks a free port."""

    build_dir: Path
    workers: int = 2
    host: str = "127.0.0.1"
    http_port: int = 8000
    router_mode: str = "kv"
    startup_timeout: float = 600.0

    def check(self) -> None:
        if not 1 <= self.workers <= 64:
            raise DFlashError(f"--workers must be in 1..64, got {self.workers}.")
        if not 0 <= self.http_port < 65536:
            raise DFlashError(f"--http-port must be in 0..65535, got {self.http_port}.")
        if self.router_mode not in ROUTER_MODES:
            raise DFlashError(f"--router-mode must be one of {', '.join(ROUTER_MODES)}, got {self.router_mode!r}.")


def dynamo_available() -> None:
    """Refuse in one sentence where ai-dynamo is not installed."""
    import importlib.util

    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.frontend") is None:
        raise DFlashError(
            "NVIDIA Dynamo is not installed; run `pip install -c constraints.txt -e '.[dynamo]'` "
            "(ai-dynamo and ai-dynamo-runtime 1.6.1 and the few packages their frontend and workers import)."
        )


class Fleet:
    """`with Fleet(cfg) as fleet:` starts the frontend and the workers, waits until the router sees every worker, and
    always stops them all."""

    name = "the Dynamo fleet"

    def __init__(self, config: FleetConfig):
        config.check()
        dynamo_available()
        self.config = config
        self.build_dir = Path(config.build_dir).expanduser().resolve()
        self.manifest = read_build(self.build_dir)
        if self.manifest["serve"].get("backend") != "torch":
            raise DFlashError(
                f"{self.build_dir} is a TensorRT-LLM deployment: on GPUs run its dynamo/launch.sh; "
                "`serve --dynamo` runs embedded (--backend torch) builds."
            )
        self.model = model_id(self.manifest)
        self.host = config.host
        self.http_port = config.http_port or free_port(config.host)
        self.system_ports: list[int] = []  # each worker's status server: /health and its engine's /metrics
        self.procs: dict[str, subprocess.Popen] = {}  # "frontend", "worker-0", ...
        self.store: Path | None = None
        self.logs = Path(tempfile.mkdtemp(prefix="dynamo-fleet-", dir=log_dir("dynamo")))  # one log per process

    @property
    def description(self) -> str:
        return f"a Dynamo fleet of {self.config.workers} worker{'s' if self.config.workers > 1 else ''} on {self.build_dir}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def metrics_url(self, worker: int) -> str:
        return f"http://{self.host}:{self.system_ports[worker]}/metrics"

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **advertised_env(self.host), "DYN_FILE_KV": str(self.store)}
        env.pop("DYN_SYSTEM_PORT", None)
        return env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], cpus: list[int] | None = None) -> None:
        def preexec():
            stop_with_parent()
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C reaches us, and we stop them all
                preexec_fn=preexec,
            )

    def start(self) -> Fleet:
        check_ports(self.host, (("--http-port", self.http_port),))
        (self.build_dir / ".dynamo").mkdir(exist_ok=True)
        self.store = Path(tempfile.mkdtemp(prefix="discovery-", dir=self.build_dir / ".dynamo"))
        env = self._env()
        plane = ["--discovery-backend", "file", "--event-plane", "zmq"]
        try:
            frontend = [sys.executable, "-m", "dynamo.frontend", "--http-host", self.host]
            frontend += ["--http-port", str(self.http_port), "--router-mode", self.config.router_mode]
            self._spawn("frontend", frontend + ["--migration-limit", str(MIGRATION_LIMIT)] + plane, env)
            shares = worker_cpu_shares(self.config.workers)
            for i, cpus in enumerate(shares):
                self.system_ports.append(system_port(self.host))
                worker_env = env | worker_thread_env(len(cpus)) | {"DYN_SYSTEM_PORT": str(self.system_ports[i])}
                cmd = [sys.executable, "-m", "trtllm_dflash.serving.dynamo_worker", "--build", str(self.build_dir)]
                self._spawn(f"worker-{i}", cmd + plane, worker_env, cpus)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _get(self, url: str) -> dict | None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return json.loads(r.read()) if r.status == 200 else None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def workers_seen(self) -> int:
        """Workers the frontend's router has discovered (its /health lists each `generate` instance)."""
        health = self._get(f"{self.url}/health") or {}
        return len({i["instance_id"] for i in health.get("instances", []) if i.get("endpoint") == "generate"})

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline:
            if gone := self.exited():  # while starting, any process that ends is a failed start
                name = gone[0]
                raise DFlashError(
                    f"The fleet's {name} exited with code {self.procs[name].returncode} while starting; see "
                    f"{self.logs / name}.log:\n{self.log_tail(name)}"
                )
            models = self._get(f"{self.url}/v1/models") or {}
            listed = any(m.get("id") == self.model for m in models.get("data", []))
            if listed and self.workers_seen() >= self.config.workers:
                return
            time.sleep(0.25)
        raise DFlashError(
            f"The Dynamo fleet was not ready after {self.config.startup_timeout:.0f} s; see {self.logs}:\n"
            + self.log_tail("frontend")
        )

    def exited(self) -> list[str]:
        """The fleet's processes that have exited."""
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    def failure(self) -> str | None:
        """None while the fleet answers: its frontend and at least one worker run (the router sends around a dead
        worker); else what to tell the user, with the log's tail of the process that ended it."""
        gone = self.exited()
        workers = [name for name in self.procs if name != "frontend"]
        if "frontend" not in gone and not set(workers) <= set(gone):
            return None
        name = "frontend" if "frontend" in gone else workers[-1]
        code = self.procs[name].returncode
        return f"The fleet's {name} exited with code {code}; see {self.logs / name}.log:\n{self.log_tail(name)}"

    def log_tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to every process (the workers first: each drains and unregisters), SIGKILL to any still running
        after `timeout`; then the discovery folder is removed."""
        order = sorted(self.procs, key=lambda name: name == "frontend")
        for name in order:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in order:
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.procs[name].kill()
                self.procs[name].wait()
        if self.store is not None:
            shutil.rmtree(self.store, ignore_errors=True)
            with contextlib.suppress(OSError):  # another fleet of this build may still use it
                self.store.parent.rmdir()
            self.store = None

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def endpoints(self) -> str:
        lines = [
            f"OpenAI   {self.url}/v1  (model '{self.model}': /v1/chat/completions, /v1/completions, /v1/models; "
            f"Dynamo's frontend, {self.config.router_mode} router)",
            *(
                f"worker {i}  {self.metrics_url(i)}  (CPUs {','.join(map(str, cpus))})"
                for i, cpus in enumerate(worker_cpu_shares(self.config.workers))
            ),
        ]
        return "\n".join(lines + [f"logs     {self.logs}"])
