"""Datasets that ship inside the package, so training, tests and benchmarks need nothing beside the install.

GSM8K train split (OpenAI, MIT license in gsm8k/LICENSE), 7,473 records, gzip-compressed; its last
GSM8K_HOLDOUT records are our unseen math evaluation set and never used for training.
"""

from __future__ import annotations

import functools
import gzip
import json
from importlib import resources

GSM8K_HOLDOUT = 200  # the last 200 train records are our unseen math eval set: never train on them


@functools.lru_cache(maxsize=1)
def _gsm8k_all() -> tuple[dict, ...]:
    raw = (resources.files(__package__) / "gsm8k" / "train.jsonl.gz").read_bytes()
    return tuple(json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip())


def gsm8k_records(holdout: bool = False) -> list[dict]:
    """GSM8K train records ({"question", "answer"}); holdout=False drops the last GSM8K_HOLDOUT, holdout=True returns only them."""
    rows = _gsm8k_all()
    return list(rows[-GSM8K_HOLDOUT:] if holdout else rows[:-GSM8K_HOLDOUT])
