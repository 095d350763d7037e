"""Datasets that ship inside the package, so training, tests and benchmarks need nothing beside the install.

GSM8K train split (OpenAI, MIT license in gsm8k/LICENSE), 7,473 records, gzip-compressed; its last
GSM8K_HOLDOUT records are our unseen math evaluation set and never used for training.
magpie-smollm2: chat questions SmolLM2-135M-Instruct wrote itself and its greedy answers (train/magpie.py),
with a data card (card.json: how they were made, filter counts).
answers-smollm2: SmolLM2-135M-Instruct's greedy answers to the other training sources' first prompts (train/answers.py),
so a training stage's data phase needs one forward per record instead of generation; card.json says how they were made.
bench-builtin: 33 prompts we wrote in 11 categories (SPEED-Bench's record shape), `trtdflash bench --dataset builtin`.
"""

from __future__ import annotations

import functools
import gzip
import json
from importlib import resources

CODE_COMPLETE_TEMPLATE = (
    "Complete the following Python function:\n```python\n{code}```"  # code prompts: training, eval, demo
)
GSM8K_HOLDOUT = 200  # the last 200 train records are our unseen math eval set: never train on them


@functools.lru_cache(maxsize=1)
def _gsm8k_all() -> tuple[dict, ...]:
    raw = (resources.files(__package__) / "gsm8k" / "train.jsonl.gz").read_bytes()
    return tuple(json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip())


def gsm8k_records(holdout: bool = False) -> list[dict]:
    """GSM8K train records ({"question", "answer"}); holdout=False drops the last GSM8K_HOLDOUT, holdout=True returns only them."""
    rows = _gsm8k_all()
    return list(rows[-GSM8K_HOLDOUT:] if holdout else rows[:-GSM8K_HOLDOUT])


@functools.lru_cache(maxsize=1)
def _magpie_all() -> tuple[dict, ...]:
    raw = (resources.files(__package__) / "magpie-smollm2" / "chat.jsonl.gz").read_bytes()
    return tuple(json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip())


def magpie_records() -> list[dict]:
    """The packaged chat set: {"key", "topic", "temperature", "top_p", "question", "answer", "answer_ids", "finished"}."""
    return list(_magpie_all())


def magpie_card() -> dict:
    """How the packaged chat set was made: target and its fingerprint, settings, filter counts, sessions."""
    return json.loads((resources.files(__package__) / "magpie-smollm2" / "card.json").read_text())


@functools.lru_cache(maxsize=1)
def _answers_all() -> tuple[dict, ...]:
    raw = (resources.files(__package__) / "answers-smollm2" / "answers.jsonl.gz").read_bytes()
    return tuple(json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip())


def answers_records() -> list[dict]:
    """The packaged greedy answers: {"key", "prompt_hash", "answer_ids", "finished"}."""
    return list(_answers_all())


def answers_card() -> dict:
    """How the packaged answers were made: target and its fingerprint, settings, per-source counts, sessions."""
    return json.loads((resources.files(__package__) / "answers-smollm2" / "card.json").read_text())
