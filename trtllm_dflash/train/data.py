"""Training data: prompts answered by the target itself (greedy, deployment chat template), on disk as jsonl.

Each record is {"source", "key", "input_ids", "loss_mask"}: prompt + response token ids, with
loss_mask 1 over the response (including its end-of-turn token). The file is appended batch by
batch and flushed, so an interrupted generation resumes where it stopped (records are keyed).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from trtllm_dflash.data import answers_card, magpie_card
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.train.records import features_path, forward_features, greedy_batch, read_dataset
from trtllm_dflash.train.sources import (
    code_package_versions,
    known_answers,
    load_prompts,
    remaining_prompts,
    source_names,
)


def generate_dataset(
    target,
    prompts: list[tuple[str, str]],
    path: Path,
    *,
    layer_ids: list[int],
    max_new_tokens: int = 256,
    batch_size: int = 16,
    time_budget: float | None = None,
    progress=None,
    answers: dict[str, list[int]] | None = None,
) -> dict:
    """Answer prompts with the target (greedy, batched) and append records to `path`.

    A prompt whose key is in `answers` keeps that answer (cut at max_new_tokens) and only needs one forward for
    its features; the others are generated in full batches as they accumulate (the rest at the end).

    The tapped features of every token are captured during generation itself (it computes them anyway)
    and appended to `features_path(path)` as bf16 rows; a record's "feat_offset" is its first row and
    it has one row per token. Prompts whose key is already in the file are skipped (resume).
    Stops after `time_budget` seconds. Returns {"records", "response_tokens", "seconds"} of this call.
    """
    from trtllm_dflash.engine.runtime import DFlashEngine

    path.parent.mkdir(parents=True, exist_ok=True)
    records = read_dataset(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # drops a torn last line
    offset = records[-1]["feat_offset"] + len(records[-1]["input_ids"]) if records else 0
    feat_path = features_path(path)
    with open(feat_path, "ab") as ff:
        ff.truncate(offset * len(layer_ids) * target.hidden_size * 2)  # rows of a batch whose records never got written
    done = {r["key"] for r in records}
    todo = remaining_prompts(prompts, done)
    engine = DFlashEngine(target, None, 1)  # its encode() is the deployment's prompt formatting
    answers = answers or {}
    t0, n_rec, n_tok = time.perf_counter(), 0, 0
    pending: list[tuple[str, list[int]]] = []  # unanswered prompts wait for a full batch: a step costs about the same
    # for 8 rows as for 64, so a few new prompts in a batch of known answers would pay a whole generation each

    def generate(rows):
        answers_, feats_ = greedy_batch(
            target,
            [ids for _, ids in rows],
            layer_ids=layer_ids,
            max_new_tokens=max_new_tokens,
            eos=engine.eos_token_ids,
        )
        return [(key, ids, answer, feat) for (key, ids), answer, feat in zip(rows, answers_, feats_)]

    with open(path, "a") as f, open(feat_path, "ab") as ff:

        def write(rows):
            nonlocal offset, n_rec, n_tok
            lines = []
            for key, prompt_ids, resp, _ in rows:
                lines.append(
                    json.dumps(
                        {
                            "source": key.split(":")[0],
                            "key": key,
                            "feat_offset": offset,
                            "input_ids": prompt_ids + resp,
                            "loss_mask": [0] * len(prompt_ids) + [1] * len(resp),
                        }
                    )
                )
                offset += len(prompt_ids) + len(resp)
                n_rec, n_tok = n_rec + 1, n_tok + len(resp)
            ff.write(torch.cat([feat for *_, feat in rows]).view(torch.int16).numpy().tobytes())
            ff.flush()  # rows before records: a record on disk always has its rows
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            if progress:
                progress(
                    f"generated {len(prompts) - len(todo) + n_rec}/{len(prompts)} records, {n_tok} response tokens, "
                    f"{n_tok / (time.perf_counter() - t0):.0f} tok/s"
                )

        for i in range(0, len(todo), batch_size):
            if time_budget is not None and time.perf_counter() - t0 > time_budget:
                break
            ready = []
            for key, prompt in todo[i : i + batch_size]:
                ids = engine.encode(prompt)
                if key in answers:
                    resp = answers[key][:max_new_tokens]
                    ready.append((key, ids, resp, forward_features(target, ids + resp, layer_ids)))
                else:
                    pending.append((key, ids))
            if len(pending) >= batch_size:
                ready += generate(pending[:batch_size])
                pending = pending[batch_size:]
            if ready:
                write(ready)
        if pending:
            write(generate(pending))
    return {"records": n_rec, "response_tokens": n_tok, "seconds": time.perf_counter() - t0}


def _asks_for_more(before: dict, sources: tuple[str, ...], minutes: float | None, num_samples: int | None) -> bool:
    """Whether a request for the data phase goes beyond the one a finished phase met: a new source, a larger time
    budget or sample cap (None = unlimited)."""
    more = lambda new, old: old is not None and (new is None or new > old)  # noqa: E731
    return (
        bool(set(sources) - set(before["sources"]))
        or more(minutes, before["minutes"])
        or more(num_samples, before["num_samples"])
    )


def prepare_data(
    target,
    sources: tuple[str, ...],
    out_dir: Path,
    *,
    layer_ids: list[int],
    num_samples: int | None,
    minutes: float | None,
    max_new_tokens: int,
    batch_size: int,
    seed: int = 0,
    progress=None,
    frozen: bool = False,
) -> dict:
    """The data phase of train-draft: answer prompts into out_dir/data.jsonl, then mark it done in data.json.

    Resumable: a rerun continues an unfinished phase (answered prompts are skipped) and skips a finished one, unless
    it asks for more (a new source, more minutes or samples): then the phase continues where it stopped, so a later
    stage grows its data with the same command. `frozen` (training has begun on these records) refuses to grow them.
    """
    meta_path, data_path = out_dir / "data.json", out_dir / "data.jsonl"
    meta = (
        json.loads(meta_path.read_text())
        if meta_path.is_file()
        else {"sources": list(sources), "target_layer_ids": list(layer_ids), "seconds": 0.0, "done": False}
    )
    if meta["target_layer_ids"] != list(layer_ids):
        raise DFlashError(
            f"{out_dir} holds data captured at target layers {meta['target_layer_ids']}, not {list(layer_ids)}; use another --output."
        )
    before = meta.get("request")  # None in a data.json written before requests were recorded: such data never grows
    if meta["done"] and before is not None and _asks_for_more(before, sources, minutes, num_samples):
        if frozen:
            raise DFlashError(
                f"{out_dir} holds a training run over its {len(read_dataset(data_path))} records, which more data would "
                "reorder; to train on more data, copy data.json, data.jsonl and data.features.bin into a new --output "
                f"and pass --init-from {out_dir / 'draft'}."
            )
        meta["done"] = False
        if progress:
            progress(
                f"The data phase continues: asked for {', '.join(sources)}, {minutes or 'unlimited'} minutes, "
                f"{num_samples or 'all'} samples ({meta['seconds'] / 60:.1f} minutes spent so far)."
            )
    meta["sources"] += [s for s in sources if s not in meta["sources"]]  # a later stage may add sources
    if not meta["done"] or before is None:  # what a finished phase met; a rerun asking for more continues it
        meta["request"] = {"sources": list(meta["sources"]), "minutes": minutes, "num_samples": num_samples}
    if not meta["done"]:
        prompts = load_prompts(sources, seed)[:num_samples]
        budget = None if minutes is None else max(0.0, minutes * 60 - meta["seconds"])
        known = known_answers(target, sources, prompts, max_new_tokens)
        r = generate_dataset(
            target,
            prompts,
            data_path,
            layer_ids=layer_ids,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            time_budget=budget,
            progress=progress,
            answers=known,
        )
        meta["seconds"] += r["seconds"]
        meta.update(
            done=True,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            dtype=str(target.dtype).removeprefix("torch."),
        )
        if {"code", "docstring"} & source_names(sources):
            meta["code_packages"] = {**meta.get("code_packages", {}), **code_package_versions()}
        if "magpie" in source_names(sources):
            card = magpie_card()
            meta["magpie"] = {
                "card": {
                    k: card[k] for k in ("target", "target_fingerprint", "dtype", "settings", "sampling", "stats")
                },
                "answers": "the packaged greedy answers" if known else "generated in this data phase",
            }
        packed = [k for k in known if not k.startswith("magpie:")]
        if packed:
            card = answers_card()
            meta["packed_answers"] = {
                "card": {k: card[k] for k in ("target", "target_fingerprint", "dtype", "max_new_tokens")},
                "prompts": len(packed),
            }
    records = read_dataset(data_path)
    if not records:
        raise DFlashError(f"No training records in {data_path}; raise --num-samples or the data time budget.")
    meta["records"] = {s: sum(r["source"] == s for r in records) for s in sorted({r["source"] for r in records})}
    meta["response_tokens"] = sum(sum(r["loss_mask"]) for r in records)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def answer_tokens(
    target,
    sources: tuple[str, ...],
    *,
    per_source: int,
    max_new_tokens: int,
    batch_size: int,
    seed: int = 0,
    progress=None,
) -> list[list[int]]:
    """The target's greedy answers to `per_source` prompts of each source (the packaged chat answers where the target
    wrote them), formatted as the deployment formats prompts: what a draft vocabulary counts."""
    from trtllm_dflash.engine.runtime import DFlashEngine

    engine = DFlashEngine(target, None, 1)
    out = []
    for source in sources:
        prompts = load_prompts((source,), seed)[:per_source]
        known = known_answers(target, (source,), prompts, max_new_tokens)
        todo = [p for key, p in prompts if key not in known]
        out += [known[key][:max_new_tokens] for key, _ in prompts if key in known]
        for i in range(0, len(todo), batch_size):
            ids = [engine.encode(p) for p in todo[i : i + batch_size]]
            answers, _ = greedy_batch(
                target, ids, layer_ids=[0], max_new_tokens=max_new_tokens, eos=engine.eos_token_ids
            )
            out += answers
            if progress:
                progress(f"{source}: answered {min(i + batch_size, len(todo))}/{len(todo)} prompts")
    return out
