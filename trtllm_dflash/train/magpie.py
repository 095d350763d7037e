"""The magpie chat source: the target writes its own user questions, then answers them greedily.

Magpie (Xu et al., 2024): given only its chat template's user-turn prefix, an instruct model continues with a
plausible user query, so chat prompts need no dataset and no hub. Diversity comes from the sampling settings
(one (temperature, top_p) pair per batch, in turn) and from a topic named in a system message for part of the
candidates. Candidates that are truncated (no end of turn within the budget), empty, too short, degenerate
(repeated n-grams, special tokens), not a question or request, or near-duplicates of an accepted question are
rejected and counted. Accepted questions are answered greedily through the deployment's chat template, exactly
as train-draft's data phase answers its other sources.

A run appends one json line per batch to RUN/magpie.jsonl (candidates, verdicts, answers), so a killed run
loses at most the batch in flight and a rerun continues with the same candidates; `pack` writes the accepted
samples, the run and a data card into the package, and `--resume-from` continues a packed run elsewhere.

    OMP_NUM_THREADS=1 python -m trtllm_dflash.train.magpie --target smollm2-135m --output runs/magpie-smollm2 \
        --until 10:15 --pack trtllm_dflash/data/magpie-smollm2
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.sampling import sample, sampling_probs
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.train.records import target_fingerprint

TOPICS = (
    "cooking and recipes",
    "travel planning",
    "personal finance",
    "health and fitness",
    "sleep",
    "gardening",
    "pets",
    "parenting",
    "relationships and friendship",
    "career advice",
    "job interviews",
    "writing emails",
    "creative writing",
    "poetry",
    "history",
    "geography",
    "physics",
    "biology",
    "chemistry",
    "astronomy",
    "the environment",
    "home repair",
    "cars",
    "cycling",
    "music",
    "movies and books",
    "video games",
    "art and drawing",
    "learning a language",
    "studying for exams",
    "mental well-being",
    "nutrition",
    "sports",
    "fashion",
    "photography",
    "small business",
    "marketing",
    "productivity",
    "public speaking",
    "philosophy",
    "economics",
    "law in everyday life",
    "technology for beginners",
    "smartphones",
    "internet safety",
    "cleaning and organizing",
    "holidays and celebrations",
    "hobbies",
    "outdoor activities",
    "shopping decisions",
)
SAMPLING = ((1.0, 1.0), (1.0, 0.95), (0.9, 0.95), (0.8, 0.9))  # (temperature, top_p) of batch b: SAMPLING[b % 4]
TOPIC_SYSTEM = "You are a helpful AI assistant. The user asks about {topic}."
# First words of requests that carry no question mark ("Write a poem about ...").
REQUEST_STARTS = frozenset(
    [
        "write",
        "explain",
        "describe",
        "give",
        "list",
        "suggest",
        "tell",
        "help",
        "create",
        "compare",
        "summarize",
        "summarise",
        "provide",
        "name",
        "recommend",
        "translate",
        "rewrite",
        "generate",
        "design",
        "plan",
        "draft",
        "outline",
        "make",
        "calculate",
        "find",
        "convert",
        "classify",
        "edit",
        "correct",
        "brainstorm",
        "identify",
        "share",
        "teach",
        "show",
        "please",
        "imagine",
        "compose",
        "analyze",
        "analyse",
        "evaluate",
        "propose",
    ]
)
STUCK_BATCHES = 20  # consecutive batches without an accepted question: the settings cannot work
REJECTS = ("truncated", "empty", "too_short", "degenerate", "not_a_question", "duplicate")
_SENTINEL = "\x00MAGPIE\x00"


@dataclass
class MagpieSettings:
    seed: int = 0
    batch_size: int = 64
    question_max_tokens: int = 96
    answer_max_tokens: int = 192  # train-draft's default --gen-max-new-tokens
    topic_share: float = 0.5  # candidates whose system message names a topic; the rest get the template's default
    min_words: int = 4
    near_duplicate_jaccard: float = 0.6  # on word 3-gram sets


def user_prefix_ids(tokenizer, system: str | None) -> list[int]:
    """Token ids of the chat template up to where the user's text starts (after an optional system message)."""
    if not tokenizer.chat_template:
        raise DFlashError("The magpie source needs a chat template, and this target's tokenizer has none.")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if _SENTINEL not in text:
        raise DFlashError(
            "The target's chat template does not place the user's text in the prompt; magpie cannot use it."
        )
    return tokenizer(text.split(_SENTINEL)[0], add_special_tokens=False)["input_ids"]


def candidate_topic(settings: MagpieSettings, i: int) -> str | None:
    """Topic of candidate i (None: no system message), fixed by the seed so a resumed run draws the same ones."""
    rng = random.Random(f"magpie:{settings.seed}:{i}")
    return rng.choice(TOPICS) if rng.random() < settings.topic_share else None


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def question_reject(text: str, special_tokens: list[str], min_words: int = 4) -> str | None:
    """Why a finished candidate is no usable question (one of REJECTS), or None to keep it; duplicates are checked apart."""
    text = text.strip()
    if not text:
        return "empty"
    words = _words(text)
    if len(words) < min_words:
        return "too_short"
    grams = list(zip(words, words[1:], words[2:]))
    counts = Counter(grams)
    if any(t in text for t in special_tokens if t) or (
        grams and (max(counts.values()) >= 3 or len(counts) < 0.7 * len(grams))
    ):
        return "degenerate"
    if "?" not in text and words[0] not in REQUEST_STARTS:
        return "not_a_question"
    return None


class NearDuplicates:
    """Questions seen so far, indexed by word 3-gram; `add` refuses one whose Jaccard overlap with any is >= threshold."""

    def __init__(self, threshold: float):
        self.threshold, self.shingles, self.index = threshold, [], {}

    @staticmethod
    def _shingles(text: str) -> frozenset:
        w = _words(text)
        return frozenset(zip(w, w[1:], w[2:])) if len(w) >= 3 else frozenset([tuple(w)])

    def add(self, text: str) -> bool:
        s = self._shingles(text)
        shared = Counter(j for g in s for j in self.index.get(g, ()))
        if any(n / (len(s) + len(self.shingles[j]) - n) >= self.threshold for j, n in shared.items()):
            return False
        for g in s:
            self.index.setdefault(g, []).append(len(self.shingles))
        self.shingles.append(s)
        return True


def _read_batches(path: Path) -> list[dict]:
    """Complete batch lines of a run, up to a torn last line (killed mid-write)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def generate_magpie(
    target,
    run_dir: Path,
    settings: MagpieSettings,
    *,
    num_questions: int | None = None,
    deadline: float | None = None,
    progress=print,
) -> dict:
    """Sample, filter and answer candidates batch by batch into run_dir/magpie.jsonl until `num_questions` are
    accepted or time.time() passes `deadline`; resumes an earlier run with the same settings. Returns its stats."""
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.train.records import greedy_batch

    run_dir.mkdir(parents=True, exist_ok=True)
    card_path, path = run_dir / "settings.json", run_dir / "magpie.jsonl"
    if card_path.is_file() and json.loads(card_path.read_text()) != asdict(settings):
        raise DFlashError(
            f"{run_dir} holds a magpie run with other settings; resume it with the same ones or use another --output."
        )
    card_path.write_text(json.dumps(asdict(settings), indent=2) + "\n")
    batches = _read_batches(path)
    path.write_text("".join(json.dumps(b) + "\n" for b in batches))  # drops a torn last line
    engine = DFlashEngine(target, None, 1)
    tok, eos = target.tokenizer, engine.eos_token_ids
    seen = NearDuplicates(settings.near_duplicate_jaccard)
    for b in batches:
        for c in b["candidates"]:
            if c["reject"] is None:
                seen.add(c["question"])
    accepted = len(seen.shingles)
    prefixes = {}
    with open(path, "a") as f:
        while (num_questions is None or accepted < num_questions) and (deadline is None or time.time() < deadline):
            b = len(batches)
            temperature, top_p = SAMPLING[b % len(SAMPLING)]
            sp, gen = (
                SamplingParams(temperature=temperature, top_p=top_p),
                torch.Generator().manual_seed(settings.seed * 1_000_003 + b),
            )
            first = b * settings.batch_size
            topics = [candidate_topic(settings, i) for i in range(first, first + settings.batch_size)]
            for t in topics:
                if t not in prefixes:
                    prefixes[t] = user_prefix_ids(tok, TOPIC_SYSTEM.format(topic=t) if t else None)
            outs, _ = greedy_batch(
                target,
                [prefixes[t] for t in topics],
                layer_ids=[0],
                max_new_tokens=settings.question_max_tokens,  # features unused
                eos=eos,
                pick=lambda logits: sample(sampling_probs(logits, sp), gen),
            )
            cands = []
            for i, (topic, ids) in enumerate(zip(topics, outs), start=first):
                text = tok.decode([t for t in ids if t not in eos]).strip()
                reason = (
                    "truncated"
                    if ids[-1] not in eos
                    else question_reject(text, tok.all_special_tokens, settings.min_words)
                )
                if reason is None and not seen.add(text):
                    reason = "duplicate"
                cands.append({"i": i, "topic": topic, "question": text, "reject": reason})
            keep = [c for c in cands if c["reject"] is None]
            if keep:
                prompts = [engine.encode(c["question"]) for c in keep]
                answers, _ = greedy_batch(
                    target, prompts, layer_ids=[0], max_new_tokens=settings.answer_max_tokens, eos=eos
                )
                for c, ids, a in zip(keep, prompts, answers):
                    c.update(prompt_tokens=len(ids), answer_ids=a, finished=a[-1] in eos)
            batch = {"batch": b, "temperature": temperature, "top_p": top_p, "candidates": cands}
            f.write(json.dumps(batch) + "\n")
            f.flush()
            batches.append(batch)
            accepted += len(keep)
            if len(batches) >= STUCK_BATCHES and not any(
                c["reject"] is None for x in batches[-STUCK_BATCHES:] for c in x["candidates"]
            ):
                raise DFlashError(
                    f"The magpie run accepted nothing in {STUCK_BATCHES} batches; allow longer questions."
                )
            if progress:
                progress(f"batch {b}: {len(keep)}/{len(cands)} accepted, {accepted} questions in all")
    return run_stats(batches)


def run_stats(batches: list[dict]) -> dict:
    """Counts of a run: candidates, accepted, rejects by reason, answer tokens and unfinished answers."""
    cands = [c for b in batches for c in b["candidates"]]
    keep = [c for c in cands if c["reject"] is None]
    return {
        "batches": len(batches),
        "candidates": len(cands),
        "accepted": len(keep),
        "rejected": {r: sum(c["reject"] == r for c in cands) for r in REJECTS},
        "answer_tokens": sum(len(c["answer_ids"]) for c in keep),
        "answers_hit_max_tokens": sum(not c["finished"] for c in keep),
        "accepted_with_topic": sum(c["topic"] is not None for c in keep),
    }


def pack(run_dir: Path, dest: Path, target, card: dict) -> dict:
    """Write the accepted samples of a run to dest/chat.jsonl.gz (question, answer text and token ids), the run
    itself to dest/run.jsonl.gz and dest/card.json (settings, stats, `card`); gzip without a timestamp, so an
    unchanged run packs to the same bytes."""
    batches = _read_batches(run_dir / "magpie.jsonl")
    settings = json.loads((run_dir / "settings.json").read_text())
    rows = [
        {
            "key": f"magpie:{c['i']}",
            "topic": c["topic"],
            "temperature": b["temperature"],
            "top_p": b["top_p"],
            "question": c["question"],
            "answer": target.tokenizer.decode(c["answer_ids"], skip_special_tokens=True),
            "answer_ids": c["answer_ids"],
            "finished": c["finished"],
        }
        for b in batches
        for c in b["candidates"]
        if c["reject"] is None
    ]
    dest.mkdir(parents=True, exist_ok=True)
    raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    (dest / "chat.jsonl.gz").write_bytes(gzip.compress(raw, mtime=0))
    (dest / "run.jsonl.gz").write_bytes(
        gzip.compress((run_dir / "magpie.jsonl").read_bytes(), mtime=0)
    )  # every candidate: resumable
    full = {
        **card,
        "target_fingerprint": target_fingerprint(target),
        "settings": settings,
        "sampling": [list(s) for s in SAMPLING],
        "topic_system": TOPIC_SYSTEM,
        "topics": list(TOPICS),
        "stats": run_stats(batches),
    }
    (dest / "card.json").write_text(json.dumps(full, indent=2) + "\n")
    return full


def unpack(packed: Path, run_dir: Path) -> None:
    """Recreate a run directory from a packed one, so another machine can continue it."""
    if (run_dir / "magpie.jsonl").is_file():
        raise DFlashError(f"{run_dir} holds a magpie run already; continue it without --resume-from.")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "settings.json").write_text(
        json.dumps(json.loads((packed / "card.json").read_text())["settings"], indent=2) + "\n"
    )
    (run_dir / "magpie.jsonl").write_bytes(gzip.decompress((packed / "run.jsonl.gz").read_bytes()))


def deadline_at(hhmm: str) -> float:
    """The wall-clock time (time.time()) of HH:MM UTC today: when a run stops starting batches."""
    h, _, m = hhmm.partition(":")
    if not (h.isdigit() and m.isdigit() and int(h) < 24 and int(m) < 60):
        raise DFlashError(f"--until {hhmm}: give a UTC time as HH:MM.")
    h, m = int(h), int(m)
    now = time.gmtime()
    return time.time() + ((h * 60 + m) - (now.tm_hour * 60 + now.tm_min)) * 60 - now.tm_sec


def main() -> None:
    ap = argparse.ArgumentParser(description="Generate (or continue) a magpie chat set with a target, then pack it.")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--output", required=True, help="Run directory (append-only magpie.jsonl; resumable).")
    ap.add_argument("--questions", type=int, default=None, help="Stop once this many questions are accepted.")
    ap.add_argument("--until", default=None, help="Stop starting batches at this UTC time (HH:MM).")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--pack", default=None, help="Write the accepted samples and the data card to this directory at the end."
    )
    ap.add_argument(
        "--pack-only", action="store_true", help="Generate nothing; only write --pack from the run as it is."
    )
    ap.add_argument(
        "--resume-from",
        default=None,
        help="A packed set (e.g. trtllm_dflash/data/magpie-smollm2) to continue in --output.",
    )
    a = ap.parse_args()

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.resolve import resolve_target

    try:
        deadline = deadline_at(a.until) if a.until else None
    except DFlashError as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    run_dir, settings = Path(a.output), MagpieSettings(seed=a.seed, batch_size=a.batch_size)
    if a.resume_from:
        unpack(Path(a.resume_from), run_dir)
    target = TargetModel.load(resolve_target(a.target, print), torch.bfloat16 if a.dtype == "bf16" else torch.float32)
    log = run_dir / "sessions.jsonl"  # wall-clock time and machine of every session that generated batches

    def record_session(t0: float) -> None:
        with open(log, "a") as f:
            f.write(
                json.dumps(
                    {
                        "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "seconds": round(time.time() - t0, 1),
                        "batches": len(_read_batches(run_dir / "magpie.jsonl")),
                        "machine": machine_info(),
                    }
                )
                + "\n"
            )

    if not a.pack_only:
        t0 = time.time()
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill, like Ctrl-C, still records the session
        try:
            stats = generate_magpie(target, run_dir, settings, num_questions=a.questions, deadline=deadline)
        except KeyboardInterrupt:
            record_session(t0)
            print("Stopped; every finished batch is kept, and rerunning the command continues.", flush=True)
            raise SystemExit(130) from None
        except DFlashError as e:  # refused before generating (other settings, no chat template): nothing to record
            print(f"Error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        record_session(t0)
        print(json.dumps(stats), flush=True)
    if a.pack:
        sessions = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
        pack(
            run_dir,
            Path(a.pack),
            target,
            {
                "target": a.target,
                "dtype": a.dtype,
                "decoding": "questions sampled, answers greedy",
                "sessions": sessions,
            },
        )


if __name__ == "__main__":
    main()
