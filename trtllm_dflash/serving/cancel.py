"""Client-disconnect signal from `postprocessing` back to the running `dflash` step.

Triton 2.51 propagates a cancelled ensemble request only to steps scheduled after the cancel
(triton-inference-server/core#263; server#6739), never to the step already running, so the
decoupled dflash model's `is_cancelled()` stays False when a client leaves an ensemble stream.
Postprocessing requests created afterwards do see it; postprocessing then drops a marker file named
by the key the dflash model attached to its responses, and the dflash model checks for it each step.
Both stubs are children of the same tritonserver, so its pid scopes the marker directory, which lives in the
user's cache (not a shared /tmp, where another user could create it first and cancel our requests).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trtllm_dflash.resolve import cache_dir


def _marker_dir() -> Path:
    return cache_dir() / "triton" / f"cancel-{os.getppid()}"


def _marker(key: str) -> Path:
    return _marker_dir() / key


def mark_cancelled(key: str) -> None:
    if key.isalnum():  # keys are uuid hex; never turn a tensor value into an arbitrary path
        _marker_dir().mkdir(parents=True, exist_ok=True)
        _marker(key).touch()


def is_cancelled(key: str) -> bool:
    return _marker(key).exists()


def clear(key: str) -> None:
    _marker(key).unlink(missing_ok=True)


def remove_all() -> None:
    """At model unload: drop this server's marker directory."""
    shutil.rmtree(_marker_dir(), ignore_errors=True)
