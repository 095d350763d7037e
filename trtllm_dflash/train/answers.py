"""The target's greedy answers to the training prompts, packed into the package so a data phase only runs forwards.

Generating answers was most of a training stage's data phase on a CPU, paid again in every session; one forward
over a known answer for its features costs less than half as much (docs/performance.md#packed-answers). So the
answers are generated once, resumably, and shipped beside the magpie chat set (`trtllm_dflash/data/answers-smollm2`).
A packed answer is used only by the model that wrote it (the target's
embedding fingerprint) and only for the prompt it answered (a hash of the prompt text: the code sources read the
installed libraries' docstrings, which change with their versions).

    python -m trtllm_dflash.train.answers --output runs/answers --data instruct:4000,gsm8k:2400,docstring:2400,code:2400 \\
        --shard 0/2 &   # and --shard 1/2 in a second process: each takes every other batch
    python -m trtllm_dflash.train.answers --output runs/answers --pack trtllm_dflash/data/answers-smollm2 --pack-only
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import sys
import time
from pathlib import Path

import torch

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.train.records import greedy_batch, prompt_hash, read_dataset
from trtllm_dflash.train.sources import load_prompts


def corpus_prompts(specs: list[str], seed: int = 0) -> list[tuple[str, str]]:
    """Each source's prompts (SOURCE:N, its first N), one source after the other, in the order a data phase takes them."""
    return [p for spec in specs for p in load_prompts((spec,), seed)]


def generate_answers(
    target,
    prompts: list[tuple[str, str]],
    path: Path,
    *,
    max_new_tokens: int,
    batch_size: int,
    shard: tuple[int, int] = (0, 1),
    deadline: float | None = None,
    progress=None,
) -> dict:
    """Answer the batches of `prompts` that fall to `shard` (index, count: every count-th batch from the index-th),
    appending {"key", "prompt_hash", "answer_ids", "finished"} to `path`; a rerun skips answered keys."""
    from trtllm_dflash.engine.runtime import DFlashEngine

    records = read_dataset(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # drops a torn last line
    done = {r["key"] for r in records}
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)][
        shard[0] :: shard[1]
    ]  # fixed per shard
    batches = [b for b in ([p for p in batch if p[0] not in done] for batch in batches) if b]
    engine = DFlashEngine(target, None, 1)  # its encode() is the deployment's prompt formatting
    t0, n_tok = time.perf_counter(), 0
    with open(path, "a") as f:
        for b, batch in enumerate(batches):
            if deadline is not None and time.time() > deadline:
                break
            ids = [engine.encode(p) for _, p in batch]
            answers, _ = greedy_batch(
                target, ids, layer_ids=[0], max_new_tokens=max_new_tokens, eos=engine.eos_token_ids
            )
            f.write(
                "".join(
                    json.dumps(
                        {
                            "key": key,
                            "prompt_hash": prompt_hash(p),
                            "answer_ids": a,
                            "finished": bool(a) and a[-1] in engine.eos_token_ids,
                        }
                    )
                    + "\n"
                    for (key, p), a in zip(batch, answers)
                )
            )
            f.flush()
            n_tok += sum(map(len, answers))
            if progress:
                progress(
                    f"batch {b + 1}/{len(batches)}: {n_tok} answer tokens, {n_tok / (time.perf_counter() - t0):.0f} tok/s"
                )
    return {"answer_tokens": n_tok, "seconds": round(time.perf_counter() - t0, 1)}


def pack(run_dir: Path, dest: Path, target, card: dict) -> dict:
    """Merge the run's answer files into dest/answers.jsonl.gz (sorted by key; gzip without a timestamp, so the same
    answers pack to the same bytes) and write dest/card.json."""
    from trtllm_dflash.train.records import target_fingerprint

    rows = {r["key"]: r for p in sorted(run_dir.glob("answers-*.jsonl")) for r in read_dataset(p)}
    if not rows:
        raise DFlashError(f"No answers in {run_dir}; generate some before packing.")
    dest.mkdir(parents=True, exist_ok=True)
    raw = "".join(json.dumps(rows[k]) + "\n" for k in sorted(rows)).encode()
    (dest / "answers.jsonl.gz").write_bytes(gzip.compress(raw, mtime=0))
    by_source: dict[str, dict] = {}
    for r in rows.values():
        s = by_source.setdefault(r["key"].split(":")[0], {"answers": 0, "answer_tokens": 0, "hit_max_tokens": 0})
        s["answers"] += 1
        s["answer_tokens"] += len(r["answer_ids"])
        s["hit_max_tokens"] += not r["finished"]
    full = {**card, "target_fingerprint": target_fingerprint(target), "sources": dict(sorted(by_source.items()))}
    (dest / "card.json").write_text(json.dumps(full, indent=2) + "\n")
    return full


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Generate (or continue) the target's greedy answers to training prompts, then pack them."
    )
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--output", required=True, help="Run directory (append-only answers-<shard>.jsonl; resumable).")
    ap.add_argument(
        "--data",
        default="instruct:4000,gsm8k:2400,docstring:2400,code:2400",
        help="Comma-separated train-draft --data sources, SOURCE or SOURCE:N (its first N prompts).",
    )
    ap.add_argument("--max-new-tokens", type=int, default=192)  # train-draft's default --gen-max-new-tokens
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--shard", default="0/1", help="i/n: answer every n-th batch from the i-th, so n processes share the work."
    )
    ap.add_argument("--until", default=None, help="Stop starting batches at this UTC time (HH:MM).")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--pack", default=None, help="Write the answers and their card to this directory at the end.")
    ap.add_argument(
        "--pack-only", action="store_true", help="Generate nothing; only write --pack from the run as it is."
    )
    a = ap.parse_args()
    try:
        run(a)
    except DFlashError as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def run(a: argparse.Namespace) -> None:
    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.resolve import resolve_target
    from trtllm_dflash.train.magpie import deadline_at
    from trtllm_dflash.train.sources import code_package_versions, source_names

    index, _, count = a.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise DFlashError(f"--shard {a.shard}: give i/n with 0 <= i < n, e.g. 0/2 and 1/2 for two processes.")
    deadline = deadline_at(a.until) if a.until else None
    specs = [s for s in a.data.split(",") if s]
    corpus = corpus_prompts(specs) if not a.pack_only else None  # refuses an unknown source before any work
    run_dir = Path(a.output)
    settings = {"data": specs, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype}
    settings_path = run_dir / "settings.json"
    if settings_path.is_file():
        made = json.loads(settings_path.read_text())
        if a.pack_only:
            settings, specs = made, made["data"]  # the card describes the run as it was made
        elif made != settings:
            raise DFlashError(
                f"{run_dir} holds answers made with other settings ({json.dumps(made)}); use another --output."
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(json.dumps(settings) + "\n")
    target = TargetModel.load(
        resolve_target(a.target, print), torch.bfloat16 if settings["dtype"] == "bf16" else torch.float32
    )
    log = run_dir / "sessions.jsonl"
    if not a.pack_only:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        t0 = time.time()
        try:
            stats = generate_answers(
                target,
                corpus,
                run_dir / f"answers-{index}.jsonl",
                max_new_tokens=a.max_new_tokens,
                batch_size=a.batch_size,
                shard=(int(index), int(count)),
                deadline=deadline,
                progress=lambda m: print(m, flush=True),
            )
        except KeyboardInterrupt:
            stats = {"stopped": True}
        with open(log, "a") as f:
            f.write(
                json.dumps(
                    {
                        "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "shard": a.shard,
                        "seconds": round(time.time() - t0, 1),
                        **stats,
                        "machine": machine_info(),
                    }
                )
                + "\n"
            )
        print(json.dumps(stats), flush=True)
    if a.pack:
        sessions = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
        card = {
            "target": a.target,
            "decoding": "greedy, the deployment's chat template",
            **settings,
            "code_packages": code_package_versions() if {"code", "docstring"} & source_names(specs) else None,
            "sessions": sessions,
        }
        print(json.dumps(pack(run_dir, Path(a.pack), target, card)["sources"]), flush=True)


if __name__ == "__main__":
    main()
