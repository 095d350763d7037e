"""An n-gram prior on the draft's greedy guesses: counts of what the target wrote after each one, two or three tokens
in its own answers, and in the request itself, added to the draft's logits slot by slot.

A small draft knows little of the language beyond its training formats: after "Limit Screen" it guesses the topic
(" sleep") where any language model says " Time". The target's answers to the training prompts (the packed answers
`draft-vocab` and `train-draft` already read) hold those short-range habits, and a request repeats its own words
(a cache language model, as speech recognisers have long kept). Each greedy guess is the argmax of

    draft logit(t) + WEIGHT * log(1 + p(t | previous tokens) / FLOOR)

where p interpolates the 4-gram, trigram and bigram counts of the answers (Witten-Bell-like: a context seen often with
few continuations trusts its own counts), and, where the same context occurred in the request's prompt or committed
tokens, takes an OWN share from what followed it there (its longest such context). The previous tokens are the
committed ones, then the guesses before this slot. Tokens never seen after the context get no bonus.

WEIGHT and OWN were chosen on a development set, prompts 40-79 of MT-Bench's first turns and of held-out GSM8K and
HumanEval (bench_acceptance.py measures prompts 0-39): with the request's counts the prior gains on every set, most
at WEIGHT 0.75 and OWN 0.5 (docs/performance.md#ngram-prior-weights).

Verification is untouched, so the output is the target's own; sampled rows draft from the draft alone (their
proposal distribution would have to be the re-weighted one, slot by slot). TensorRT-LLM's DFlash path has no such
option.

`draft_ngram.npz` beside a draft's weights (numpy, no pickles): for context length n = 1..CONTEXT the arrays `n{n}.keys`
(the context's tokens as one base-`vocab_rows` number, ascending), `n{n}.offsets` [C+1], `n{n}.tokens` and
`n{n}.counts` (the tokens seen after it and how often); `meta`, a JSON string: `format`, `vocab_rows`, `weight`,
`floor`, `smoothing`, `own` (absent in the first files: 0, the answers' counts alone), `source`.
"""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.draft_vocab import optional_file

FILE = "draft_ngram.npz"  # not .safetensors: a draft's *.safetensors are its weights to converters and builds
FORMAT = 1
CONTEXT = 3  # tokens of context: 4-gram counts backed by trigram and bigram ones
WEIGHT, FLOOR, SMOOTHING, OWN = 0.75, 1e-4, 3.0, 0.5  # see the module docstring
MEMO = 4096  # contexts whose probabilities are remembered (tens of MB at most: an entry holds all that followed its last token)


class NgramPrior:
    """The counts of one file, and the greedy choice they re-weight."""

    def __init__(
        self,
        tables: dict[int, tuple[np.ndarray, ...]],
        vocab_rows: int,
        weight: float = WEIGHT,
        floor: float = FLOOR,
        smoothing: float = SMOOTHING,
        own: float = OWN,
    ):
        self.tables, self.vocab_rows = tables, vocab_rows
        # per context: its count and the weight its own counts get against the shorter context's
        self.totals = {
            n: np.add.reduceat(c, o[:-1]).astype(np.float64) if len(k) else np.zeros(0)
            for n, (k, o, _, c) in tables.items()
        }
        self.trust = {n: t / (t + smoothing * np.diff(tables[n][1])) for n, t in self.totals.items()}
        self.weight, self.floor, self.smoothing, self.own = weight, floor, smoothing, own
        self.columns: np.ndarray | None = None  # full token id -> column of the draft's vocabulary (-1: not in it)
        self._memo: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray] | None] = {}

    def use_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Guesses are columns of the draft vocabulary's logits (models/draft_vocab.py), or token ids without one."""
        if token_ids is None:
            self.columns = None
            return
        self.columns = np.full(self.vocab_rows, -1, dtype=np.int64)
        self.columns[token_ids.numpy()] = np.arange(len(token_ids))

    def _find(self, context: list[int]) -> int | None:
        keys = self.tables[len(context)][0]
        key = 0
        for t in context:
            key = key * self.vocab_rows + t
        i = int(keys.searchsorted(key))
        return i if i < len(keys) and keys[i] == key else None

    def probabilities(self, context: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(tokens, p) after the last CONTEXT tokens of `context`: the longest context's counts, interpolated with the
        shorter ones'; None if even the last token was never seen. Remembered: a rejected block's guesses are drafted
        again from the same contexts at the next step (read-only arrays, shared)."""
        key = tuple(context[-CONTEXT:])
        hit = self._memo.get(key, False)
        if hit is False:
            if len(self._memo) >= MEMO:
                self._memo.clear()
            hit = self._memo[key] = self._probabilities(key)
        return hit

    def _probabilities(self, context: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """Whatever followed a context also followed its shorter suffixes, so the shortest context's tokens (ascending)
        hold every longer one's."""
        tokens, p = None, None
        for n in range(1, min(CONTEXT, len(context)) + 1):
            i = self._find(context[-n:])
            if i is None:
                break
            _, offsets, all_tokens, counts = self.tables[n]
            t, q = all_tokens[offsets[i] : offsets[i + 1]], counts[offsets[i] : offsets[i + 1]] / self.totals[n][i]
            if tokens is None:
                tokens, p = t, q
                continue
            w = self.trust[n][i]
            p = (1 - w) * p
            p[tokens.searchsorted(t)] += w * q
        return None if tokens is None else (tokens, p)

    def mixed(self, context: list[int], history: RequestCounts | None) -> tuple[np.ndarray, np.ndarray] | None:
        """(tokens, p) after `context`: the answers' probabilities, with the request's own taking an `own` share where
        they know the context (alone, that share of them). The request's few tokens are merged in without a sort."""
        hit = self.probabilities(context)
        mine = history.probabilities(context) if history is not None and self.own else None
        if mine is None:
            return hit
        if hit is None:
            return mine[0], self.own * mine[1]
        (tokens, p), (own_tokens, q) = hit, mine
        at = tokens.searchsorted(own_tokens).clip(max=len(tokens) - 1)
        known = tokens[at] == own_tokens
        p = (1 - self.own) * p
        p[at[known]] += self.own * q[known]
        if known.all():
            return tokens, p
        return np.concatenate([tokens, own_tokens[~known]]), np.concatenate([p, self.own * q[~known]])

    def greedy(self, logits: torch.Tensor, history: RequestCounts, token_ids: torch.Tensor | None) -> list[int]:
        """Guesses for consecutive slots from their draft logits [k, N] (N: the draft vocabulary's columns, in
        `token_ids` order, or the whole vocabulary) after the request's committed tokens, each slot's prior
        conditioned on the guesses before it. In numpy: a handful of small operations a slot, where each torch call
        would cost more than its arithmetic."""
        out, context, rows = [], history.tokens[-CONTEXT:], logits.float().numpy()
        for row in rows:
            best = int(row.argmax())
            hit = self.mixed(context, history)
            if hit is not None:
                tokens, p = hit
                cols = tokens if self.columns is None else self.columns[tokens]
                scores = row[cols] + self.weight * np.log1p(p / self.floor)
                scores[cols < 0] = -np.inf  # outside the draft vocabulary: never guessed
                m = int(scores.argmax())
                if scores[m] > row[best]:
                    best = int(cols[m])
            token = best if token_ids is None else int(token_ids[best])
            out.append(token)
            context = (context + [token])[-CONTEXT:]
        return out


class RequestCounts:
    """What followed each context of 1..CONTEXT tokens in one request (its prompt, then its committed tokens)."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = list(tokens)
        self._next: dict[tuple[int, ...], dict[int, int]] = {}
        self._counted = 0  # tokens[:_counted] are counted: the rest when the draft next reads the counts

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def probabilities(self, context: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(tokens ascending, p) after the longest of the last CONTEXT..1 tokens of `context` seen in the request."""
        seq, nxt = self.tokens, self._next
        for end in range(self._counted, len(seq)):
            t = seq[end]
            for n in range(1, min(CONTEXT, end) + 1):
                after = nxt.setdefault(tuple(seq[end - n : end]), {})
                after[t] = after.get(t, 0) + 1
        self._counted = len(seq)
        for n in range(min(CONTEXT, len(context)), 0, -1):
            after = self._next.get(tuple(context[-n:]))
            if after:
                tokens = np.fromiter(sorted(after), np.int64, len(after))
                counts = np.fromiter((after[t] for t in tokens.tolist()), np.float64, len(after))
                return tokens, counts / counts.sum()
        return None


def count_ngrams(answers: list[list[int]], vocab_rows: int) -> dict[int, tuple[np.ndarray, ...]]:
    """(keys, offsets, tokens, counts) per context length 1..CONTEXT over the answers (contexts within an answer)."""
    tables = {}
    for n in range(1, CONTEXT + 1):
        pairs = Counter()
        for a in answers:
            for i in range(n, len(a)):
                key = 0
                for t in a[i - n : i]:
                    key = key * vocab_rows + t
                pairs[(key, a[i])] += 1
        items = sorted(pairs.items())
        keys = np.array([k for (k, _), _ in items], dtype=np.int64)
        starts = np.r_[True, keys[1:] != keys[:-1]] if len(keys) else np.zeros(0, dtype=bool)
        tables[n] = (
            keys[starts],
            np.r_[np.flatnonzero(starts), len(keys)].astype(np.int64),
            np.array([t for (_, t), _ in items], dtype=np.int64),
            np.array([c for _, c in items], dtype=np.int64),
        )
    return tables


def write_draft_ngram(path: str | Path, answers: list[list[int]], vocab_rows: int, source: dict) -> dict:
    """Count the answers' n-grams into `path` (atomically). Returns what was counted."""
    tables = count_ngrams(answers, vocab_rows)
    arrays = {}
    for n, (keys, offsets, tokens, counts) in tables.items():
        arrays |= {
            f"n{n}.keys": keys,
            f"n{n}.offsets": offsets,
            f"n{n}.tokens": tokens.astype(np.int32),
            f"n{n}.counts": counts.astype(np.int32),
        }
    stats = {
        "answers": len(answers),
        "answer_tokens": sum(map(len, answers)),
        "contexts": {str(n): len(t[0]) for n, t in tables.items()},
        "entries": {str(n): len(t[2]) for n, t in tables.items()},
    }
    meta = {
        "format": FORMAT,
        "vocab_rows": vocab_rows,
        "weight": WEIGHT,
        "floor": FLOOR,
        "smoothing": SMOOTHING,
        "own": OWN,
        "source": {**source, **stats},
    }
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
    tmp.replace(path)
    return stats


def read_draft_ngram(draft_dir: str | Path, vocab_rows: int) -> NgramPrior | None:
    """The prior of a draft's n-gram file, or None if it has none; a file that is there but malformed is an error."""
    path = optional_file(draft_dir, FILE)
    if path is None:
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            tables = {
                n: tuple(f[f"n{n}.{name}"].astype(np.int64) for name in ("keys", "offsets", "tokens", "counts"))
                for n in range(1, CONTEXT + 1)
            }
        rows, weight, floor, smoothing = (
            int(meta["vocab_rows"]),
            float(meta["weight"]),
            float(meta["floor"]),
            float(meta["smoothing"]),
        )
        own = float(meta.get("own", 0.0))
        ok = (
            meta.get("format") == FORMAT
            and 0.0 <= own <= 1.0
            and all(
                k.ndim == 1 and len(o) == len(k) + 1 and o[-1] == len(t) == len(c) for k, o, t, c in tables.values()
            )
        )
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
        ok = False
    if not ok:
        raise DFlashError(
            f"{path} is not a draft n-gram file (format {FORMAT}); rewrite it with `trtdflash draft-vocab` or delete it."
        )
    if rows != vocab_rows or any(len(t) and (t.min() < 0 or t.max() >= vocab_rows) for _, _, t, _ in tables.values()):
        raise DFlashError(
            f"{path} counts tokens of a vocabulary of {rows} rows, not this target's {vocab_rows}; it belongs to another target."
        )
    return NgramPrior(tables, vocab_rows, weight, floor, smoothing, own)
