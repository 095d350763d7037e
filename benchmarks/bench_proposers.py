"""Where a step's guesses could come from, and what choosing among them per step could give: the DFlash draft, prompt
lookup, and a suffix index over the target's own earlier answers.

Replays the target's greedy outputs on bench_acceptance.py's held-out sets. At every position of every output it
counts the guesses each proposer would have had accepted:
- the draft (the packaged one, or `--draft`): one target forward over prompt and output for its features, then the draft's block at every
  position at once, teacher-forced as in training (its vocabulary file and n-gram prior applied, as the runtime does);
- prompt lookup: lookup.py's NgramIndex over the prompt and the output so far, as the runtime;
- a suffix index over the target's answers that ship in the package (magpie and the packed answers of the training
  sources, none to a held-out prompt): the longest suffix of the context found in them, continued by its most frequent
  next token while the product of those tokens' shares stays at or above MIN_SHARE (vLLM's suffix decoding keeps such
  an index of earlier outputs; unlike it, the guesses here are not capped at the matched suffix's length).
It then walks each output a step at a time under rules for choosing a step's proposer, and under the oracle that takes
whichever would accept most: what verifying all of them in one forward (a tree) could reach. And it splits the draft's
first guesses by how sure the target itself was of the token guessed (its top probability there, CONFIDENCE bins): a
set whose answers the draft follows less well either holds more tokens the target was unsure of, or the draft
guesses worse at equal confidence, which more training of the kind it had may mend. The outputs come from a
real run with the runtime's own rule (lookup where it matches, else the draft), whose measured tau checks the replay
of that rule (with the shipped prior and lookup: `--ngram-weight`, `--ngram-own` and `--lookup-guesses` change the
replay only, so with them set the check no longer applies). The outputs are the target's whatever the draft (greedy
decoding is lossless), so `--outputs FILE` keeps them for the next run, which then replays another `--draft` in about
4 minutes instead of decoding again: a quick screen of candidate drafts (bench_acceptance.py, which decodes, is the
measurement that counts).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_proposers.py --math 40 --code 40 --chat 40
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_proposers.py --outputs /tmp/outputs.json --draft runs/my-draft/draft
    .venv/bin/python benchmarks/bench_proposers.py --math 40 --code 40 --chat 40 --magpie-held-out 125   # and the held-out magpie questions
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import torch

MIN_SHARE = 0.1  # the default of vLLM's suffix_decoding_min_token_prob (vllm/config/speculative.py)
MAX_MATCH = 16  # longest context suffix looked up in the answers
SURE = 0.9  # a rule takes the suffix index's guesses over the draft's when the first one's share is at least this
CONFIDENCE = (0.5, 0.8, 0.95)  # edges of the bins of the target's top probability at the token a first guess guesses


class SuffixIndex:
    """Suffix array over concatenated answers (-1 between them), sorted on each suffix's first DEPTH tokens."""

    DEPTH = 32  # > MAX_MATCH + the guesses a step can take

    def __init__(self, answers: list[list[int]]):
        self.t = np.array([x for a in answers for x in (*a, -1)], dtype=np.int64)
        n, rank = len(self.t), self.t + 1
        sa, k = np.argsort(rank, kind="stable"), 1
        while k < self.DEPTH:  # prefix doubling: order by the first 2k tokens from the order by the first k
            second = np.full(n, -1, dtype=np.int64)
            second[: n - k] = rank[k:]
            sa = np.lexsort((second, rank))
            new = np.r_[True, (rank[sa][1:] != rank[sa][:-1]) | (second[sa][1:] != second[sa][:-1])]
            rank = np.empty(n, dtype=np.int64)
            rank[sa] = np.cumsum(new) - 1
            k *= 2
        self.sa = sa

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """Of the suffixes sa[lo:hi] (sorted, sharing their first `depth` tokens), those whose next token is `token`."""
        col = lambda i: self.t[p] if (p := self.sa[i] + depth) < len(self.t) else -2  # noqa: E731
        a, b = lo, hi
        while a < b:
            m = (a + b) // 2
            a, b = (m + 1, b) if col(m) < token else (a, m)
        first, b = a, hi
        while a < b:
            m = (a + b) // 2
            a, b = (m + 1, b) if col(m) <= token else (a, m)
        return first, a

    def _find(self, pattern: list[int]) -> tuple[int, int]:
        lo, hi = 0, len(self.sa)
        for j, x in enumerate(pattern):
            lo, hi = self._narrow(lo, hi, j, x)
            if lo == hi:
                break
        return lo, hi

    def propose(self, context: list[int], limit: int) -> tuple[list[int], float]:
        """Guesses, and the first one's share of what followed the matched suffix in the answers."""
        for n in range(min(MAX_MATCH, len(context)), 0, -1):  # the longest suffix of the context the answers hold
            lo, hi = self._find(context[-n:])
            if hi > lo:
                break
        else:
            return [], 0.0
        out, share, first, depth = [], 1.0, 0.0, n
        while len(out) < limit:
            pos = self.sa[lo:hi] + depth
            nxt = self.t[pos[pos < len(self.t)]]
            nxt = nxt[nxt >= 0]
            if not len(nxt):
                break
            values, counts = np.unique(nxt, return_counts=True)
            best = int(counts.argmax())
            share *= counts[best] / (hi - lo)
            if share < MIN_SHARE:
                break
            out.append(int(values[best]))
            first = first or share
            lo, hi = self._narrow(lo, hi, depth, out[-1])
            depth += 1
        return out, first


def accepted(guesses: list[int], truth: list[int]) -> int:
    k = 0
    while k < len(guesses) and k < len(truth) and guesses[k] == truth[k]:
        k += 1
    return k


@torch.no_grad()
def draft_accepted(target, draft, prompt: list[int], output: list[int]) -> tuple[list[int], list[float]]:
    """[i]: draft guesses accepted at the step that starts after output[:i+1] is committed (output[i] its first token),
    and the target's top probability at output[i + 1], the token the first of them guesses; one target forward."""
    from trtllm_dflash.models.draft_ngram import RequestCounts
    from trtllm_dflash.train.trainer import acceptance_stats, block_hidden, build_blocks

    seq, b = prompt + output, draft.config.block_size
    # train/records.py's forward_features, with every position's logits
    with target.tapped(draft.config.target_layer_ids):
        target_logits, feats = target.forward(torch.tensor([seq]), 0, target.new_cache(1, len(seq)), capture=True)
    confidence = target_logits[0, len(prompt) : len(seq) - 1].float().softmax(-1).amax(-1).tolist()
    # features rounded to bf16, as train-draft stores them (the fp32 runtime keeps them in fp32): the replay's draft-only
    # tau was within 0.01 of bench_acceptance's for the drafts compared (TRAINING.md)
    feats = feats[0].to(torch.bfloat16).to(target.dtype)
    anchors = torch.arange(len(prompt), len(seq) - 1)
    response = torch.zeros(len(seq), dtype=torch.long)
    response[len(prompt) :] = 1
    noise, pos, labels, valid = build_blocks(torch.tensor(seq), response, anchors, b, draft.config.mask_token_id)
    hidden = block_hidden(draft, target.embed_tokens, feats, noise, pos, anchors)
    if draft.ngram is None:
        guess = draft.compute_logits(hidden, target.lm_head).argmax(-1)  # -inf outside the draft's vocabulary
    else:  # as the runtime: slot by slot, each re-weighted by the n-gram prior given the guesses before it
        logits = draft.compute_logits(hidden, target.lm_head, full=False).view(len(anchors), b, -1)
        history, rows = RequestCounts(prompt), []
        for i, a in enumerate(anchors.tolist()):
            history.extend(seq[len(history.tokens) : a + 1])  # committed: the prompt, then the output up to the anchor
            rows.append([-1] + draft.ngram.greedy(logits[i, 1:], history, draft.vocab_token_ids))
        guess = torch.tensor(rows).flatten()
    return acceptance_stats(guess == labels, valid, b)[0].tolist(), confidence


def by_confidence(runs: list[tuple[list[int], list[float]]]) -> list[dict]:
    """The draft's first guesses (accepted counts d, the target's confidence c per position) in CONFIDENCE bins."""
    edges = (0.0, *CONFIDENCE, 1.01)
    pairs = [(di, ci) for d, c in runs for di, ci in zip(d, c)]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        inside = [di for di, ci in pairs if lo <= ci < hi]
        rows.append(
            {
                "target_top_probability": f"{lo:.2f}-{min(hi, 1.0):.2f}",
                "share": round(len(inside) / max(len(pairs), 1), 3),
                "first_guess_accepted": round(sum(di >= 1 for di in inside) / len(inside), 3) if inside else None,
            }
        )
    return rows


def walk(n: int, accept) -> tuple[int, int]:
    """(tokens, steps) of decoding an output of n tokens when the step after output[:i+1] accepts accept(i) guesses."""
    i = tokens = steps = 0
    while i < n - 1:
        a = min(accept(i), n - 2 - i)
        steps, tokens, i = steps + 1, tokens + a + 1, i + a + 1
    return tokens, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--math", type=int, default=40)
    ap.add_argument("--code", type=int, default=40)
    ap.add_argument("--chat", type=int, default=40)
    ap.add_argument(
        "--magpie-held-out",
        type=int,
        default=0,
        help="Packaged chat questions train-draft never trains on (125 of them).",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft", default=None, help="Draft directory to replay (default: the packaged draft).")
    ap.add_argument("--outputs", default=None, help="JSON file of the target's outputs: read if there, else written.")
    ap.add_argument(
        "--no-draft-ngram",
        dest="draft_ngram",
        action="store_false",
        help="Replay the draft's own argmax, without its n-gram prior (models/draft_ngram.py).",
    )
    ap.add_argument(
        "--first",
        type=int,
        default=0,
        help="Skip that many prompts of each set: 40 replays prompts 40-79, which bench_acceptance.py's 40 leave "
        "for tuning (the n-gram prior's weights were chosen there).",
    )
    ap.add_argument(
        "--ngram-weight", type=float, default=None, help="Replay the prior at this weight instead of its file's."
    )
    ap.add_argument(
        "--ngram-own", type=float, default=None, help="... and with this share for the request's own counts."
    )
    ap.add_argument(
        "--lookup-guesses",
        type=int,
        default=None,
        help="Replay prompt lookup with up to this many guesses a step (default: the runtime's, lookup.MAX_GUESSES).",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from bench_acceptance import prompt_sets

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.data import answers_records, magpie_records
    from trtllm_dflash.engine.lookup import MAX_GUESSES, NgramIndex
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.models.checkpoint import load_draft
    from trtllm_dflash.models.draft_ngram import read_draft_ngram
    from trtllm_dflash.models.draft_vocab import read_draft_vocab
    from trtllm_dflash.resolve import resolve_draft

    engine = DFlashEngine.load(
        "smollm2-135m", a.draft, dtype="fp32", speculation="fixed", draft_ngram=a.draft_ngram, progress=lambda m: None
    )
    draft_dir = resolve_draft(a.draft, "smollm2-135m")
    cache_path = Path(a.outputs) if a.outputs else None
    cached = json.loads(cache_path.read_text()) if cache_path and cache_path.is_file() else {}
    draft = load_draft(draft_dir, torch.float32).eval()  # unpacked: block_hidden runs its training-time forward
    draft.use_vocab(read_draft_vocab(draft_dir, engine.target.lm_head.out_features), engine.target.lm_head)
    draft.ngram = read_draft_ngram(draft_dir, engine.target.lm_head.out_features) if a.draft_ngram else None
    if draft.ngram is not None:
        draft.ngram.use_vocab(draft.vocab_token_ids)
        draft.ngram.weight = draft.ngram.weight if a.ngram_weight is None else a.ngram_weight
        draft.ngram.own = draft.ngram.own if a.ngram_own is None else a.ngram_own
    limit = draft.config.block_size - 1  # the draft's and the suffix index's guesses a step
    lookup_limit = MAX_GUESSES if a.lookup_guesses is None else a.lookup_guesses  # ... and lookup's
    t0 = time.perf_counter()
    from trtllm_dflash.train.trainer import TrainArgs, held_out  # the magpie questions --magpie-held-out poses stay out

    trained = [r for r in magpie_records() if not held_out(r["key"], TrainArgs.val_fraction)]
    corpus = SuffixIndex([r["answer_ids"] for r in trained] + [r["answer_ids"] for r in answers_records()])
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "target": "smollm2-135m",
        "draft": str(a.draft or "packaged default"),
        "dtype": "fp32",
        "decoding": "greedy",
        "max_new_tokens": a.max_new_tokens,
        "block_size": draft.config.block_size,
        "corpus_tokens": int(len(corpus.t)),
        "corpus_seconds": round(time.perf_counter() - t0, 1),
        "min_share": MIN_SHARE,
        "first_prompt": a.first,
        "lookup_guesses": lookup_limit,
        "draft_ngram_prior": None if draft.ngram is None else {"weight": draft.ngram.weight, "own": draft.ngram.own},
        "sets": {},
    }
    for name, prompts in prompt_sets(a.math, a.code, a.chat, a.magpie_held_out, first=a.first).items():
        if not prompts:
            continue
        runs, measured, confidence = [], [], []
        for key, text in prompts:
            prompt = engine.encode(text)
            hit = cached.get(name, {}).get(key)
            if hit and hit["prompt"] == prompt and hit["max_new_tokens"] == a.max_new_tokens:
                out, tau = hit["output"], None
            else:
                r = engine.generate(text, max_new_tokens=a.max_new_tokens)  # the runtime's rule: lookup, else the draft
                out, tau = r.token_ids, r.stats.acceptance_length
                cached.setdefault(name, {})[key] = {"prompt": prompt, "output": out, "max_new_tokens": a.max_new_tokens}
            d, c = draft_accepted(engine.target, draft, prompt, out)
            confidence.append((d, c))
            history, look, suffix = NgramIndex(prompt + out[:1]), [], []
            for i in range(len(out) - 1):
                ctx, truth = history.tokens, out[i + 1 :]
                found = history.propose(lookup_limit)
                look.append(accepted(found, truth) if found else None)
                guesses, share = corpus.propose(ctx, limit)
                suffix.append((accepted(guesses, truth), share))
                history.extend([out[i + 1]])
            runs.append((len(out), d, look, suffix))
            measured.append(tau)
            print(
                f"{name} {key}: " + ("output from " + str(cache_path) if tau is None else f"measured tau {tau:.2f}"),
                flush=True,
            )
        rules = {
            "draft": lambda d, lk, s: d,
            "suffix index": lambda d, lk, s: s[0],
            "lookup, else draft (the runtime)": lambda d, lk, s: d if lk is None else lk,
            f"lookup, else suffix index if its first share >= {SURE}, else draft": lambda d, lk, s: (
                lk if lk is not None else (s[0] if s[1] >= SURE else d)
            ),
            "longest of draft and lookup (one tree verify)": lambda d, lk, s: max(d, lk or 0),
            "longest of draft, lookup and suffix index (one tree verify)": lambda d, lk, s: max(d, lk or 0, s[0]),
        }
        taus = [t for t in measured if t is not None]  # a measured tau only where this run decoded
        result = {
            "prompts": len(runs),
            "measured_tau_mean": round(statistics.mean(taus), 3) if len(taus) == len(runs) else None,
            "replay": {},
        }
        for rule_name, rule in rules.items():
            per = [walk(n, lambda i: rule(d[i], lk[i], s[i])) for n, d, lk, s in runs]
            result["replay"][rule_name] = {
                "tau_mean": round(statistics.mean(t / max(st, 1) for t, st in per), 3),
                "tau_pooled": round(sum(t for t, _ in per) / max(sum(st for _, st in per), 1), 3),
            }
        result["draft_first_guess_by_target_confidence"] = by_confidence(confidence)
        report["sets"][name] = result
        print(
            f"== {name}: measured {result['measured_tau_mean']}; "
            + "; ".join(f"{k} {v['tau_mean']:.2f}" for k, v in result["replay"].items()),
            flush=True,
        )
        print(
            "   the draft's first guess by the target's top probability there: "
            + "; ".join(
                f"{r['target_top_probability']}: {r['share']:.0%} of positions, {r['first_guess_accepted']} accepted"
                for r in result["draft_first_guess_by_target_confidence"]
            ),
            flush=True,
        )
    if cache_path:
        cache_path.write_text(json.dumps(cached) + "\n")
    out = Path(
        a.out or Path(__file__).parent / "results" / f"proposers-smollm2-135m-{time.strftime('%Y%m%d-%H%M')}.json"
    )
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
