"""Run the real NVIDIA Triton Inference Server on a build's model repository.

Where a system `tritonserver` is on PATH (NGC containers) it is used with its own backends.
Otherwise the 2.51 server bundled in the `nvidia-pytriton` wheel is used, set up as in the tested
CPU recipe: a backend directory holding the python backend and the stub built for this Python,
`PATH` starting with this venv's bin (the stub finds its interpreter and packages through
`python3` on PATH), `LD_LIBRARY_PATH` with this Python's libpython and the wheel's libs,
and `--disable-auto-complete-config` (the templates are complete).

`TritonServer` is a context manager, so tests and `trtdflash quickstart` always stop the server.
With `openai_port` set it also runs the OpenAI-compatible frontend (`openai_server`) on a thread of this
process, started once Triton is ready and stopped before it, so the frontend never outlives the server.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.deploy import read_build
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import cache_dir
from trtllm_dflash.threads import server_thread_env


@dataclass(frozen=True)
class ServerConfig:
    """Where to serve; port 0 picks a free port. Loopback unless told otherwise."""

    build_dir: Path
    host: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    openai_port: int | None = None  # None: no OpenAI-compatible frontend
    startup_timeout: float = 600.0
    log_verbose: int = 0

    def check(self) -> None:
        for name in ("grpc_port", "http_port", "metrics_port", "openai_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port < 65536:
                raise DFlashError(f"--{name.replace('_', '-')} must be in 0..65535, got {port}.")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are picked, so the kernel never hands one out twice
    (picked one at a time, two of a server's ports once came out equal and tritonserver refused to start)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def _pytriton_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(
            "No tritonserver on PATH and nvidia-pytriton is not installed; run `pip install nvidia-pytriton==0.7.0`."
        )
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def locate_tritonserver() -> tuple[Path, Path | None, dict[str, str]]:
    """(binary, backend dir or None for the server's default, extra env)."""
    venv_bin = str(Path(sys.executable).parent)
    env = {"PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}
    system = shutil.which("tritonserver")
    if system:
        return Path(system), None, env
    root = _pytriton_root()
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.is_file():
        raise DFlashError(f"nvidia-pytriton ships no python backend stub for Python {pyver}; use Python 3.8-3.13.")
    venv_key = hashlib.sha256(str(root).encode()).hexdigest()[:8]  # one backend dir per installation
    backends = cache_dir() / "triton" / f"backends-py{pyver}-{venv_key}"
    py_backend = backends / "python"
    py_backend.mkdir(parents=True, exist_ok=True)
    for src in (
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        link = py_backend / src.name
        if not (link.is_symlink() and os.readlink(link) == str(src)):
            tmp = link.with_name(f".{link.name}.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(src)
            tmp.replace(link)  # atomic: a concurrent server start never sees a missing file
    libs = [
        sysconfig.get_config_var("LIBDIR") or "",
        str(root.parent.parent / "nvidia_pytriton.libs"),
        os.environ.get("LD_LIBRARY_PATH", ""),
    ]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    return root / "bin" / "tritonserver", backends, env


def log_dir(server: str, keep: int = 20) -> Path:
    """`<cache>/<server>/logs`, where each start of a server writes its log (a file or a folder named `<server>-*`);
    only the newest `keep` are kept."""
    d = cache_dir() / server / "logs"
    d.mkdir(parents=True, exist_ok=True)
    for old in sorted(d.glob(f"{server}*"), key=lambda p: p.stat().st_mtime)[:-keep]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return d


def check_ports(host: str, ports) -> None:
    """Refuse in one sentence a (flag, port) whose port something listens on (None: not used)."""
    for flag, port in ((f, p) for f, p in ports if p is not None):
        with socket.socket() as sock:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
            )  # as servers do: TIME_WAIT is fine, a listener is not
            try:
                sock.bind((host, port))
            except OSError as e:
                raise DFlashError(
                    f"Cannot use {host}:{port} ({e.strerror}); pick another {flag} or stop what is listening there."
                ) from None


def stop_with_parent() -> None:
    """Linux: the server gets SIGTERM if we die without stopping it (e.g. SIGKILL), so it is never orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TritonServer:
    """A tritonserver process on a build's `triton_repo/`; `with TritonServer(cfg) as s:` starts and always stops it."""

    def __init__(self, config: ServerConfig):
        config.check()
        self.manifest = read_build(config.build_dir)
        self.repo = Path(config.build_dir).expanduser().resolve() / self.manifest["serve"]["model_repository"]
        self.model = self.manifest["serve"]["model"]
        self.config = config
        self.host = config.host
        spare = iter(free_ports(4, config.host))  # for the ports given as 0
        self.grpc_port = config.grpc_port or next(spare)
        self.http_port = config.http_port or next(spare)
        self.metrics_port = config.metrics_port or next(spare)
        self.openai_port = None if config.openai_port is None else config.openai_port or next(spare)
        self.proc: subprocess.Popen | None = None
        self._stopping = False  # SIGTERM sent (once: a graceful stop is under way)
        self.frontend = None  # the OpenAIFrontend while running
        self.log_path = Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log", dir=log_dir("triton"))[1])

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def openai_url(self) -> str | None:
        return None if self.openai_port is None else f"http://{self.host}:{self.openai_port}/v1"

    def command(self) -> tuple[list[str], dict[str, str]]:
        binary, backends, env = locate_tritonserver()
        cmd = [
            str(binary),
            f"--model-repository={self.repo}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--disable-auto-complete-config",
            "--allow-gpu-metrics=false",
            f"--log-verbose={self.config.log_verbose}",
        ]
        if backends is not None:
            cmd.append(f"--backend-directory={backends}")
        return cmd, {**os.environ, **server_thread_env(), **env}  # the models' torch threads: see threads.py

    def _check_ports(self) -> None:
        check_ports(
            self.host,
            (
                ("--grpc-port", self.grpc_port),
                ("--http-port", self.http_port),
                ("--metrics-port", self.metrics_port),
                ("--openai-port", self.openai_port),
            ),
        )

    def start(self) -> TritonServer:
        self._check_ports()
        cmd, env = self.command()
        self._stopping = False
        with open(self.log_path, "wb") as log:
            # Own session: a Ctrl-C in the terminal reaches us, and we stop the server gracefully.
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=stop_with_parent,
            )
        try:
            self._wait_ready()
            if self.openai_port is not None:
                from trtllm_dflash.serving.openai_server import OpenAIFrontend

                self.frontend = OpenAIFrontend(
                    self.config.build_dir, self.manifest, self.grpc_url, self.host, self.openai_port
                ).start()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DFlashError(
                    f"tritonserver exited with code {self.proc.returncode} while starting; see {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise DFlashError(
            f"tritonserver was not ready after {self.config.startup_timeout:.0f} s; see {self.log_path}:\n{self.log_tail()}"
        )

    name = "tritonserver"

    @property
    def description(self) -> str:
        return f"tritonserver on {self.repo}"

    def failure(self) -> str | None:
        """None while the server runs; what to tell the user once it has exited."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"tritonserver exited with code {self.proc.returncode}; see {self.log_path}:\n{self.log_tail()}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """The frontend first (its open requests are cancelled); then SIGTERM = graceful (unloads models, stops stubs,
        frees /dev/shm); SIGKILL if it hangs."""
        self.request_stop()
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def request_stop(self) -> None:
        """`stop` without waiting for tritonserver to exit (it takes 2-3 s to unload the models): `stop_all`."""
        frontend, self.frontend = self.frontend, None
        try:
            if frontend is not None:
                frontend.stop()
        finally:
            if self.proc is not None and self.proc.poll() is None and not self._stopping:
                self.proc.send_signal(signal.SIGTERM)
                self._stopping = True

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def endpoints(self) -> str:
        lines = [
            f"gRPC     {self.grpc_url}  (model '{self.model}', streaming via stream_infer)",
            f"HTTP     http://{self.http_url}  (POST /v2/models/{self.model}/generate, /generate_stream)",
            f"metrics  {self.metrics_url}",
        ]
        if self.openai_port is not None:
            from trtllm_dflash.serving.openai_server import model_id

            lines.append(
                f"OpenAI   {self.openai_url}  (model '{model_id(self.manifest)}': /v1/completions, /v1/chat/completions, /v1/models; /health)"
            )
        return "\n".join(lines + [f"log      {self.log_path}"])


def stop_all(servers: list[TritonServer], timeout: float = 30.0) -> None:
    """Stop several servers side by side: each spends 2-3 s unloading its models, at the same time as the others."""
    for server in servers:
        server.request_stop()
    for server in servers:
        server.stop(timeout)


def serve_forever(server, progress=print) -> int:
    """`trtdflash serve`: start `server` (a TritonServer or a dynamo Fleet), print its endpoints, stop it gracefully on
    SIGINT/SIGTERM, or report it when it exits by itself; returns the exit code."""
    stop = {"signal": None, "ready": False}

    def on_signal(signum, _frame):
        if not stop["ready"]:
            raise KeyboardInterrupt  # still starting: abort the wait; start() stops what it started
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        progress(f"Starting {server.description} ...")
        server.start()
        stop["ready"] = True
        progress("Ready.\n" + server.endpoints())
        while stop["signal"] is None and (failure := server.failure()) is None:
            time.sleep(0.2)
        if stop["signal"] is not None:
            progress(f"Got {signal.Signals(stop['signal']).name}; stopping {server.name} gracefully...")
            server.stop()
            return 0
        progress(failure)
        return 1
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
