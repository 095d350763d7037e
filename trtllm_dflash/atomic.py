"""Directories appear whole or not at all: write into a temporary sibling, then swap it in.

A writer of `dest` builds `.<name>.tmp<pid>` beside it and calls `replace_dir`, which swaps the two in one
rename (Linux renameat2 RENAME_EXCHANGE), so `dest` is always the previous complete version or the new one.
Where the filesystem cannot exchange, two renames park the previous version as `.<name>.old<pid>` for a moment;
a writer killed in that moment leaves `dest` absent, and `recover` puts the parked version back. Writers that
may run at once hold `locked(dest)` (an flock on `.<name>.lock`, removed on release), and call `recover` under it to
clear what a killed writer left behind.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from trtllm_dflash.errors import DFlashError

AT_FDCWD, RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the C library or the filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished `tmp` to `dest`, replacing an existing `dest` (readers never see a mix, or nothing)."""
    if not dest.exists():
        tmp.rename(dest)
    elif _exchange(tmp, dest):
        shutil.rmtree(tmp)  # now the previous version
    else:
        old = dest.with_name(f".{dest.name}.old{os.getpid()}")
        dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old)


@contextmanager
def locked(dest: Path, what: str = "build"):
    """Hold an exclusive lock on `dest` for the block; a second writer gets one sentence instead of waiting or mixing
    files. The lock file is removed on release; a writer that locked a file just removed tries again on the new one."""
    lock_path = dest.with_name(f".{dest.name}.lock")
    while True:
        f = open(lock_path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise DFlashError(
                f"Another {what} (process {holder}) is writing {dest} right now; wait for it to finish or pick "
                "another output directory."
            ) from None
        try:
            if os.stat(lock_path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # while still holding it: nobody can take a lock on a file about to vanish
        f.close()


def recover(dest: Path) -> list[str]:
    """Clear what killed writers of `dest` left (call it holding `locked(dest)`): a version parked by an interrupted
    swap goes back to `dest` if `dest` is missing, and every temporary sibling (a conversion's offloaded layers too) is removed. Returns the names found."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(tmp|old|offload)\d+")
    leftovers = sorted(p for p in dest.parent.iterdir() if pattern.fullmatch(p.name)) if dest.parent.is_dir() else []
    for p in leftovers:
        if p.name.startswith(f".{dest.name}.old") and not dest.exists():
            p.rename(dest)
        else:
            shutil.rmtree(p)
    return [p.name for p in leftovers]


def write_json(path: Path, data) -> None:
    """`data` as indented JSON at `path`, whole or not at all (written beside it, then renamed); folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
