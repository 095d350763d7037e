"""vLLM's speculators format for DFlash drafts, to and from z-lab's (the format TensorRT-LLM and our runtime load).

The facts, from vllm-project/speculators v0.7.0.1 (`src/speculators/convert/dflash/converter.py`,
`src/speculators/models/dflash/config.py`) and vLLM's loader (`vllm/transformers_utils/configs/speculators/algos.py`,
`update_dflash`, after vllm PR #40727):

- a speculators checkpoint is one whose config.json has `speculators_model_type` ("dflash" here) and
  `architectures: ["DFlashSpeculator"]`;
- the draft's transformer config sits under `transformer_layer_config` (z-lab's top level without `architectures`,
  `auto_map`, `block_size`, `dflash_config`, `num_target_layers`); `block_size` and `mask_token_id` are top level;
- `aux_hidden_state_layer_ids` = z-lab's `dflash_config.target_layer_ids` + 1 (z-lab reads `hidden_states[id + 1]`,
  index 0 being the embedding output; speculators names the layer itself);
- `speculators_config.proposal_methods[greedy].speculative_tokens` = block_size - 1, and `verifier` names the target;
- the layer tensors are unchanged (`layers.N.*`, `fc`, `hidden_norm`, `norm`, no prefix on either side); speculators
  stores the verifier's `embed_tokens.weight` and `lm_head.weight` beside them, and `d2t`/`t2d` where the draft's
  vocabulary is smaller than the target's.

Upstream converts only z-lab -> speculators; the way back is the same map inverted, as vLLM's loader applies it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trtllm_dflash.atomic import locked, replace_dir
from trtllm_dflash.config import DRAFT_ARCHITECTURE, max_draft_len
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import CARD_FILE, _weight_files
from trtllm_dflash.models.draft_ngram import FILE as NGRAM_FILE
from trtllm_dflash.models.draft_vocab import FILE as VOCAB_FILE
from trtllm_dflash.resolve import cache_dir, resolve_draft
from trtllm_dflash.untrusted import check_checkpoint_dir, check_links, read_json

MODEL_TYPE = "dflash"
ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_VERSION = "0.7.0.1"  # the release whose converter and config these facts come from
NOT_LAYER_CONFIG = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")  # upstream's
VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # stored by speculators, shared with the target by z-lab
VOCAB_MAPS = ("d2t", "t2d")
# dflash_config keys of our own (train-draft's), kept under OURS so a round trip returns them; PretrainedConfig, which
# speculators' config is, keeps a key it does not know as an attribute.
OUR_KEYS, OURS = ("short_blocks",), "trtllm_dflash_config"
# Our files beside a draft's weights (its card, vocabulary, n-gram prior), carried unchanged either way.
BESIDE = (CARD_FILE, VOCAB_FILE, NGRAM_FILE, "TRAINING.md", "README.md")


def is_speculators(path: Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and "speculators_model_type" in read_json(cfg, "draft config")


def zlab_config(spec: dict) -> dict:
    """A speculators DFlash config.json as z-lab's (the transformer config at top level, dflash_config rebuilt)."""
    if spec.get("speculators_model_type") != MODEL_TYPE:
        raise DFlashError(
            f"This speculators checkpoint is a {spec.get('speculators_model_type')!r} speculator, not a DFlash one."
        )
    layer = spec.get("transformer_layer_config")
    aux = spec.get("aux_hidden_state_layer_ids")
    missing = [k for k, v in (("transformer_layer_config", layer), ("aux_hidden_state_layer_ids", aux)) if not v]
    missing += [k for k in ("block_size", "mask_token_id") if spec.get(k) is None]
    if missing:
        raise DFlashError(f"The speculators DFlash config has no {', '.join(missing)}; it cannot describe a draft.")
    if not isinstance(layer, dict) or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise DFlashError("The speculators DFlash config's transformer_layer_config or layer ids are malformed.")
    if spec.get("sample_from_anchor"):
        raise DFlashError(
            "This speculators draft samples from its anchor slot (sample_from_anchor), which z-lab's format and "
            "TensorRT-LLM's DFlash do not run."
        )
    out = {k: v for k, v in layer.items() if k not in NOT_LAYER_CONFIG}
    out["architectures"] = [DRAFT_ARCHITECTURE]
    out["block_size"] = spec["block_size"]
    out["dflash_config"] = {"mask_token_id": spec["mask_token_id"], "target_layer_ids": [i - 1 for i in aux]}
    out["dflash_config"] |= {k: v for k, v in (spec.get(OURS) or {}).items() if k in OUR_KEYS}
    return out


def speculators_config(zlab: dict, verifier: dict, verifier_name: str) -> dict:
    """z-lab's config.json as speculators writes it, for the target described by `verifier` (its config.json)."""
    dflash = dict(zlab.get("dflash_config") or {})
    block = dflash.get("block_size", zlab.get("block_size"))
    ids, mask = dflash.get("target_layer_ids"), dflash.get("mask_token_id")
    if block is None or ids is None or mask is None:
        raise DFlashError("The draft's config.json lacks block_size, target_layer_ids or mask_token_id.")
    if zlab.get("hidden_size") != verifier.get("hidden_size"):
        raise DFlashError(
            f"The draft's hidden_size {zlab.get('hidden_size')} is not its target's {verifier.get('hidden_size')}."
        )
    ours = {k: dflash[k] for k in OUR_KEYS if k in dflash}
    extra = sorted(set(dflash) - {"block_size", "mask_token_id", "target_layer_ids", *OUR_KEYS})
    if extra:
        raise DFlashError(
            f"The draft's dflash_config carries {', '.join(extra)}, which the speculators format has no place for."
        )
    layer = {k: v for k, v in zlab.items() if k not in NOT_LAYER_CONFIG}
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": layer["vocab_size"],
        "block_size": block,
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "mask_token_id": mask,
        "target_hidden_size": None,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        **({OURS: ours} if ours else {}),
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": max_draft_len(block),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier.get("architectures") or [])},
        },
    }


def _tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in _weight_files(path, what):
        with safe_open(f, framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return out


def _write(dest: Path, config: dict, tensors: dict[str, torch.Tensor], extra: tuple[Path, ...] = ()) -> Path:
    """config.json + model.safetensors (+ files copied beside them), appearing whole or not at all."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise DFlashError(f"{dest} is a file; pass a directory to write the draft into.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with locked(dest, "draft conversion"):
        tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors", {"format": "pt"})
            for f in extra:
                shutil.copyfile(f, tmp / f.name)
            replace_dir(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def to_zlab(src: Path, dest: Path) -> Path:
    """A speculators DFlash checkpoint as a z-lab one: the verifier's embedding and LM head dropped (z-lab drafts
    share the target's), the layer tensors unchanged."""
    src = Path(src)
    check_checkpoint_dir(src, "Draft")
    config = zlab_config(read_json(src / "config.json", "draft config"))
    tensors = _tensors(src, "Draft")
    if any(k in tensors for k in VOCAB_MAPS):
        raise DFlashError(
            "This speculators draft guesses among a reduced vocabulary (d2t/t2d), which TensorRT-LLM's DFlash loader "
            "does not take; use a full-vocabulary draft."
        )
    for k in VERIFIER_TENSORS:
        tensors.pop(k, None)
    return _write(dest, config, tensors, tuple(src / f for f in BESIDE if (src / f).is_file()))


def to_speculators(src: Path, dest: Path, target_dir: Path, target_name: str | None = None) -> Path:
    """A z-lab draft as speculators writes it for `target_dir`'s model: the target's embedding and LM head (its tied
    embedding where it has no LM head of its own) stored beside the layer tensors, the config rewritten."""
    src, target_dir = Path(src), Path(target_dir)
    check_checkpoint_dir(src, "Draft")
    check_links(target_dir)
    verifier = read_json(target_dir / "config.json", "target config")
    config = speculators_config(
        read_json(src / "config.json", "draft config"), verifier, target_name or target_dir.name
    )
    tensors = _tensors(src, "Draft")
    target = _tensors(target_dir, "Target")
    embed = target.get("model.embed_tokens.weight", target.get("embed_tokens.weight"))
    if embed is None:
        raise DFlashError(f"Target {target_dir} has no embed_tokens weight to store beside the draft.")
    head = target.get("lm_head.weight", embed).clone()  # a tied head is its own tensor on disk, as speculators saves it
    tensors["embed_tokens.weight"], tensors["lm_head.weight"] = embed, head
    return _write(dest, config, tensors, tuple(src / f for f in BESIDE if (src / f).is_file()))


def zlab_view(path: Path, cache: Path) -> Path:
    """`path` itself for a z-lab draft; for a speculators one, its z-lab conversion, made once under `cache` (keyed
    by the checkpoint's config and tensor files), so `build` and the runtime take either format."""
    path = Path(path)
    if not is_speculators(path):
        return path
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    dest = cache / "drafts" / f"speculators-{h.hexdigest()[:16]}"
    if not (dest / "config.json").is_file():
        to_zlab(path, dest)
    return dest


def resolve_any_draft(name_or_path: str | None, target: str) -> Path | None:
    """`resolve.resolve_draft`, a speculators checkpoint taken too: what `build` and the runtime load."""
    path = resolve_draft(name_or_path, target)
    return None if path is None else zlab_view(path, cache_dir())
