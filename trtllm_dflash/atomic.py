"""Directories appear whole or not at all: write into a temporary sibling, then swap it in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished `tmp` to `dest`, replacing an existing `dest` with two renames (readers never see a mix)."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old{os.getpid()}")
        dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old)
    else:
        tmp.rename(dest)
