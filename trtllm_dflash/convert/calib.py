"""Calibration text: GSM8K (shipped with the package), Python source, everyday chat, or the user's own file."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from trtllm_dflash.errors import DFlashError

CALIB_MAX_TOKENS = 256  # per sample: enough context for activation ranges, cheap on CPU
DRAFT_ANCHORS = 4  # draft blocks per calibration sample

CALIB_SOURCES = ("gsm8k", "code", "chat")
CHAT_QUESTIONS = (
    "What is a good way to start learning to cook at home?",
    "Can you explain why the sky is blue in simple terms?",
    "How do I politely decline an invitation to a party?",
    "What should I pack for a three-day hiking trip?",
    "Give me three tips for sleeping better.",
    "How does a credit card differ from a debit card?",
    "What are some easy houseplants for a beginner?",
    "Write a short thank-you note to a colleague who helped me move.",
    "How can I make my morning routine less rushed?",
    "What is the difference between weather and climate?",
    "Suggest a simple weekly budget plan for a student.",
    "How do I remove a coffee stain from a shirt?",
)
CODE_MODULES = (
    "heapq",
    "bisect",
    "textwrap",
    "functools",
    "fractions",
    "statistics",
    "colorsys",
    "difflib",
    "shlex",
    "graphlib",
    "queue",
    "string",
    "calendar",
    "fnmatch",
    "glob",
    "base64",
)
CODE_CHARS = 2000  # one prompt = the first characters of one module: a few functions with docstrings


def calibration_texts(source: str, samples: int) -> list[str]:
    """`samples` texts from a named source or a .txt / .jsonl file (one record per line: text, prompt, question or content)."""
    if source == "gsm8k":
        from trtllm_dflash.data import gsm8k_records

        texts = [f"{r['question']}\n{r['answer']}" for r in gsm8k_records()]
    elif source == "code":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [
            (stdlib / f"{m}.py").read_text(encoding="utf-8")[:CODE_CHARS]
            for m in CODE_MODULES
            if (stdlib / f"{m}.py").is_file()
        ]
    elif source == "chat":
        texts = list(CHAT_QUESTIONS)
    else:
        texts = _file_texts(Path(source))
    if not texts:
        raise DFlashError(
            f"Calibration data '{source}' holds no text; pass gsm8k, code, chat or a non-empty .txt/.jsonl file."
        )
    return [texts[i % len(texts)] for i in range(samples)] if len(texts) < samples else texts[:samples]


def _file_texts(path: Path) -> list[str]:
    if not path.is_file():
        raise DFlashError(f"Calibration data '{path}' is neither {', '.join(CALIB_SOURCES)} nor an existing file.")
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"Calibration file {path} is not readable UTF-8 text ({e}).") from None
    if path.suffix != ".jsonl":
        return lines
    texts = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise DFlashError(
                f"Calibration file {path} line {n} is not JSON; use one JSON object per line in a .jsonl file."
            ) from None
        text = (
            rec
            if isinstance(rec, str)
            else next(
                (
                    rec[k]
                    for k in ("text", "prompt", "question", "content")
                    if isinstance(rec, dict) and isinstance(rec.get(k), str)
                ),
                None,
            )
        )
        if text is None:
            raise DFlashError(f"Calibration file {path} line {n} has no text, prompt, question or content string.")
        texts.append(text)
    return texts
