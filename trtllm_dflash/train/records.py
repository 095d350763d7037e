"""Training records on disk (jsonl + a features file) and the batched greedy generation that writes them;
the helpers every data source shares. Nothing here imports the other training modules."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from trtllm_dflash.engine.sampling import greedy


def read_dataset(path: Path) -> list[dict]:
    """Records of a dataset file, up to a torn last line (killed mid-write)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def features_path(data_path: Path) -> Path:
    return data_path.with_suffix(".features.bin")


def read_features(data_path: Path, width: int) -> torch.Tensor:
    """All feature rows of a dataset as one memory-mapped bf16 tensor [rows, width]."""
    import numpy as np

    raw = np.memmap(
        features_path(data_path), dtype=np.int16, mode="c"
    )  # copy-on-write: torch wants a writable buffer; nothing writes
    return torch.from_numpy(raw[: raw.size // width * width].reshape(-1, width)).view(torch.bfloat16)


@torch.inference_mode()
def greedy_batch(
    target, prompts: list[list[int]], *, layer_ids: list[int], max_new_tokens: int, eos: set[int], pick=None
):
    """Greedy answers of a batch of prompts, and the tapped features [len(prompt + answer), n_sel*H] (bf16) of each.

    `pick` (last-position logits [rows, V] -> next ids [rows]) replaces the argmax: the magpie source samples
    its questions with it.

    The deployment's own forward (`TargetModel.forward` over a static per-slot cache): each prompt prefilled into its
    slot, then one token per live row a step, each row attending to its own positions only; when rows end, the live
    ones move down to the first slots. HF's loop over a static cache attended over the whole cache every step
    (benchmarks/bench_datagen.py). The answer keeps its end token; its features row is zeros (never fed back, training
    never reads it).
    """
    n = len(prompts)
    pick = pick or greedy
    cache = target.new_cache(slots=n, capacity=max(map(len, prompts)) + max_new_tokens)
    per_row: list[list[torch.Tensor]] = []
    answers: list[list[int]] = [[] for _ in range(n)]
    with target.tapped(layer_ids):
        last = []
        for i, p in enumerate(prompts):
            logits, feats = target.forward(torch.tensor([p]), 0, cache, capture=True, logits_to_keep=1, first_slot=i)
            per_row.append([feats[0].to(torch.bfloat16)])
            last.append(logits[0, -1])
        nxt = pick(torch.stack(last))
        rows, pos = list(range(n)), [len(p) for p in prompts]  # per slot: its prompt, the position of its next token
        for step in range(max_new_tokens):
            for slot, t in enumerate(nxt.tolist()):
                answers[rows[slot]].append(t)
            live = [slot for slot, t in enumerate(nxt.tolist()) if t not in eos]
            if step + 1 == max_new_tokens or not live:
                break
            if len(live) < len(rows):  # live rows move down to the first slots: a forward's rows are contiguous slots
                for dst, src in enumerate(live):
                    if dst != src:
                        cache.move(src, dst, pos[src])
                rows, pos, nxt = [rows[s] for s in live], [pos[s] for s in live], nxt[live]
            logits, feats = target.forward(nxt[:, None], pos, cache, capture=True)  # [rows, 1, V], [rows, 1, n_sel*H]
            for slot, f in enumerate(feats[:, 0].to(torch.bfloat16)):
                per_row[rows[slot]].append(f[None])
            pos = [p + 1 for p in pos]
            nxt = pick(logits[:, -1])
    return answers, [torch.cat(f + [f[0].new_zeros(1, f[0].shape[-1])]) for f in per_row]


@torch.inference_mode()
def forward_features(target, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Tapped features [len(ids), n_sel*H] (bf16) of one forward over a prompt and an answer known already: the
    deployment's forward into a one-slot cache, which is faster than HF's decoder
    (docs/performance.md#forward-features)."""
    with target.tapped(layer_ids):
        _, feats = target.forward(torch.tensor([ids]), 0, target.new_cache(1, len(ids)), capture=True, logits_to_keep=1)
    return feats[0].to(torch.bfloat16)


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def target_fingerprint(target) -> str:
    """A short hash of the target's input embeddings (as bf16, whatever dtype it was loaded in): answers in a chat
    set are reused only by the model that wrote them."""
    import hashlib

    emb = target.model.get_input_embeddings().weight.detach().to(torch.bfloat16).contiguous()
    return hashlib.sha256(emb.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
