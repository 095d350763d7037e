"""`trtdflash draft-vocab`: give a draft the vocabulary and n-gram prior counted from the target's own answers.

It runs the target (to answer the prompts), so it lives with the training code; the files it writes are read by
the runtime through models/draft_vocab.py and models/draft_ngram.py."""

from __future__ import annotations

from pathlib import Path

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.draft_vocab import FILE, rank_tokens, write_draft_vocab


def build_draft_vocab(
    target: str,
    output: str | Path,
    *,
    sources: tuple[str, ...],
    size: int,
    per_source: int,
    max_new_tokens: int,
    batch_size: int,
    dtype: str = "bf16",
    ngram: bool = True,
    progress=print,
) -> dict:
    """Count the target's greedy answers to the sources' prompts and write the `size` most frequent tokens to
    `output` (a draft directory, or a file path); `ngram`: their n-grams too, into the n-gram prior's file beside it
    (models/draft_ngram.py). Returns the vocabulary file's source record."""
    from trtllm_dflash.cpu import resolve_dtype
    from trtllm_dflash.engine.runtime import DTYPES
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.resolve import resolve_target
    from trtllm_dflash.train.data import answer_tokens

    output = Path(output)
    path = output / FILE if output.is_dir() else output
    if not path.parent.is_dir():
        raise DFlashError(
            f"{path.parent} does not exist; pass a draft directory or a file path in an existing directory."
        )
    dtype = resolve_dtype(dtype)
    tm = TargetModel.load(resolve_target(target, progress), DTYPES[dtype])
    answers = answer_tokens(
        tm, sources, per_source=per_source, max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress
    )
    source = {
        "target": target,
        "dtype": dtype,
        "data": list(sources),
        "prompts_per_source": per_source,
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy answers, chat template",
    }
    stats = write_draft_vocab(path, rank_tokens(answers), size, tm.lm_head.out_features, source) | {"path": str(path)}
    if ngram:
        from trtllm_dflash.models.draft_ngram import FILE as NGRAM_FILE
        from trtllm_dflash.models.draft_ngram import write_draft_ngram

        ngram_path = path.parent / NGRAM_FILE
        stats["ngram"] = write_draft_ngram(ngram_path, answers, tm.lm_head.out_features, source) | {
            "path": str(ngram_path)
        }
    return stats
