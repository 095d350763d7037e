"""Folders that ship with the package, found through importlib.resources: the same code works from a wheel,
an editable install and a source checkout, and nothing is looked up beside the package.

`triton_repo`, `build_configs` and `plugins` live at the repository's top level and are mapped into the
package by pyproject.toml; `drafts` and `data` live inside `trtllm_dflash/`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

MAPPED = ("triton_repo", "build_configs", "plugins")
INSIDE = ("drafts", "data")


def package_dir(name: str) -> Path:
    """The installed folder `name` as a real path (the package is never zipped: setuptools installs it unpacked)."""
    if name in MAPPED:
        root = resources.files(f"trtllm_dflash.{name}")
    elif name in INSIDE:
        root = resources.files("trtllm_dflash") / name
    else:
        raise ValueError(f"unknown package folder {name!r}")
    return Path(str(root))
