"""A TensorRT-LLM deployment starts the way DEPLOY.md says, with nothing but its folder: `./launch.sh` in a fresh
virtual environment that has the container's Python packages (CONTAINER_PACKAGES) and not trtllm-dflash, the real
tritonserver on PATH as in NVIDIA's container, and our embedded engine behind the LLM API (the one swap)."""

import subprocess
import sys
from importlib.metadata import version

import pytest

from trtllm_dflash.clients.client import CompletionRequest, complete
from trtllm_dflash.deploy.gpu_check import Launched
from trtllm_dflash.deploy.trtllm_backend import CONTAINER_PACKAGES
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError

PROMPT = "Write a Python function that adds two numbers."
MAX_TOKENS = 24
BLOCK = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    """The container's Python (numpy<2 and the pinned versions of this environment) and a `tritonserver` on PATH."""
    root = tmp_path_factory.mktemp("container")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pins = [f"{name}=={version(name)}" for name in CONTAINER_PACKAGES] + [
        f"nvidia-pytriton=={version('nvidia-pytriton')}"
    ]
    subprocess.run([str(venv / "bin/pip"), "install", "-q", *pins], check=True, capture_output=True)
    assert (
        subprocess.run(
            [str(venv / "bin/python"), "-c", "import trtllm_dflash"], cwd=root, capture_output=True
        ).returncode
        != 0
    )
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    site = venv / f"lib/python{pyver}/site-packages"
    triton = site / "pytriton/tritonserver"
    backends = root / "backends/python"  # laid out as /opt/tritonserver/backends/python in the container
    backends.mkdir(parents=True)
    for src in (
        triton / "backends/python/libtriton_python.so",
        triton / "backends/python/triton_python_backend_utils.py",
        triton / f"python_backend_stubs/{pyver}/triton_python_backend_stub",
    ):
        (backends / src.name).symlink_to(src)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    libdir = subprocess.run(
        [str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (bin_dir / "tritonserver").write_text(
        f"#!/bin/sh\nexport LD_LIBRARY_PATH={libdir}:{site / 'nvidia_pytriton.libs'}\n"
        f'exec {triton / "bin/tritonserver"} --backend-directory={backends.parent} --allow-gpu-metrics=false "$@"\n'
    )
    (bin_dir / "tritonserver").chmod(0o755)
    return {"PATH": f"{bin_dir}:{venv / 'bin'}:/usr/bin:/bin", "HOME": str(root)}


@pytest.fixture(scope="module")
def deployment(trtllm_deployment):
    return trtllm_deployment


def test_launch_sh_serves_the_deployment_without_the_package(container, deployment, target_dir):
    env = {**container, "TRTDFLASH_LLM_ENGINE": "embedded"}
    try:
        with Launched(deployment, "triton", env, timeout=300) as server:  # ./launch.sh, as the GPU check starts it
            done = complete(server.url, CompletionRequest(PROMPT, MAX_TOKENS, True), timeout=120)
    except DFlashError as e:
        pytest.fail(f"{e}\n{(deployment / 'triton.log').read_text()[-3000:]}")
    engine = DFlashEngine.load(
        str(target_dir),
        "smollm2-135m",
        dtype="bf16",
        block_size=BLOCK,
        speculation="fixed",
        lookup=False,
        progress=lambda m: None,
    )
    reference = engine.generate(PROMPT, max_new_tokens=MAX_TOKENS)
    assert done.text == reference.text and done.num_tokens == reference.stats.num_tokens
    assert (done.drafted_tokens, done.accepted_tokens) == (
        reference.stats.drafted_tokens,
        reference.stats.accepted_tokens,
    )
