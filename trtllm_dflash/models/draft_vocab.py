"""A draft vocabulary: the draft guesses only among the target's most frequent output tokens (FR-Spec; the idea behind
SGLang's `--speculative-token-map` and EAGLE-3's `draft_vocab_size`).

A DFlash draft reads the target's LM head for its guesses. For SmolLM2-135M that head is 49,152 rows x 576 (56 MB in
bf16), read once per step for the draft's guesses and once more for the verify; on a CPU that read is memory-bound
and a noticeable share of a step (docs/performance.md#draft-vocab-head). Restricted to the N tokens the target writes
most, the draft's head is N rows. Verification is untouched and sees the whole vocabulary: a token outside the list is
never guessed, so it is rejected like any wrong guess, and the output stays the target's own (greedy token for token;
sampling in distribution, since the draft's distribution q is simply zero outside the list).

`draft_vocab.json` beside a draft's weights: {"format": 1, "token_ids": [...most frequent first], "source": {...}}.
Tokens never seen in the counted answers fill the list up to its size in id order.
It is optional: a draft without one guesses over the whole vocabulary. TensorRT-LLM's DFlash path has no such option
and reads the full head.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from trtllm_dflash.errors import DFlashError

FILE = "draft_vocab.json"
FORMAT = 1


def optional_file(draft_dir: str | Path, name: str) -> Path | None:
    """A file a draft may carry beside its weights, or None; a symbolic link is refused, as for the weights."""
    path = Path(draft_dir) / name
    if not path.is_file():
        return None
    if path.is_symlink():
        raise DFlashError(f"{path} is a symbolic link; copy the file into the draft directory.")
    return path


def read_draft_vocab(draft_dir: str | Path, vocab_rows: int) -> torch.Tensor | None:
    """The token ids of a draft's vocabulary file [N] (int64), or None if it has none. A file that is there but
    malformed is an error: silently guessing over another vocabulary would hide it."""
    path = optional_file(draft_dir, FILE)
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
        ids = raw["token_ids"]
        ok = raw.get("format") == FORMAT and isinstance(ids, list) and ids and all(type(i) is int for i in ids)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise DFlashError(
            f"{path} is not a draft vocabulary (format {FORMAT}: a non-empty list of token ids); "
            f"rewrite it with `trtdflash draft-vocab` or delete it."
        )
    if min(ids) < 0 or max(ids) >= vocab_rows or len(set(ids)) != len(ids):
        raise DFlashError(f"{path} lists token ids outside 0..{vocab_rows - 1} or twice; it belongs to another target.")
    return torch.tensor(ids, dtype=torch.long)


def rank_tokens(answers: list[list[int]]) -> list[tuple[int, int]]:
    """(token id, count) over the target's answers, most frequent first; ties by id, so the ranking is reproducible."""
    counts = Counter(t for answer in answers for t in answer)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def write_draft_vocab(
    path: str | Path, ranked: list[tuple[int, int]], size: int, vocab_rows: int, source: dict
) -> dict:
    """Keep the `size` most frequent tokens; if fewer were seen, fill up with the unseen ids in ascending order (a BPE
    vocabulary numbers its merges roughly by frequency). Returns the counts' coverage by the kept tokens."""
    if not 1 <= size <= vocab_rows:
        raise DFlashError(f"--size must be between 1 and the target's {vocab_rows} tokens, got {size}.")
    ids = [t for t, _ in ranked[:size]]
    seen = set(ids)
    ids += [t for t in range(vocab_rows) if t not in seen][: size - len(ids)]
    total = sum(c for _, c in ranked)
    stats = {
        "size": len(ids),
        "seen_tokens_kept": min(size, len(ranked)),
        "distinct_tokens_seen": len(ranked),
        "answer_tokens": total,
        "coverage": round(sum(c for _, c in ranked[:size]) / total, 5) if total else 0.0,
    }
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "token_ids": ids, "source": {**source, **stats}}) + "\n")
    tmp.replace(path)
    return stats
