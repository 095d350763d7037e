"""Read and write drafts in the z-lab format (config.json + model.safetensors), as TensorRT-LLM, vLLM and SGLang load them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from trtllm_dflash.atomic import replace_dir
from trtllm_dflash.config import DRAFT_ARCHITECTURE, DraftConfig, is_draft_architecture
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.quantized import load_quantized_draft, quantized_shapes, read_quant_spec
from trtllm_dflash.untrusted import (
    CONFIG_ERRORS,
    check_checkpoint_dir,
    check_config_values,
    check_links,
    one_line,
    read_json,
)


def read_draft_config(path: Path) -> DraftConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise DFlashError(
            f"Draft checkpoint {path} has no config.json; pass a DFlash draft directory (config.json + model.safetensors)."
        )
    check_links(Path(path))  # a config.json linked to a file elsewhere is never read
    raw = read_json(cfg_file, "draft config")
    check_config_values(raw, cfg_file)
    archs = raw.get("architectures") or []
    if archs and not is_draft_architecture(archs):  # a DFlash2 draft's label (DFlash2DraftModel, ...) counts too
        raise DFlashError(
            f"{cfg_file} describes {json.dumps(archs)[:80]}, not a {DRAFT_ARCHITECTURE} or a DFlash2 draft; pass a "
            "DFlash draft checkpoint."
        )
    try:
        return DraftConfig.from_dict(raw)
    except CONFIG_ERRORS as e:
        raise DFlashError(f"Draft config {cfg_file} is invalid ({one_line(e)}); re-export the draft.") from None


def _weight_files(path: Path, what: str = "Draft") -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise DFlashError(f"{what} checkpoint {path} has no model.safetensors.")


def _check_names_and_shapes(path: Path, shapes: dict[str, tuple[int, ...]], config: DraftConfig) -> None:
    with torch.device("meta"):  # expected shapes without allocating weights
        expected = {k: tuple(v.shape) for k, v in DFlashDraftModel(config).state_dict().items()}
    # A DFlash2 draft's convolutions and selector: checked from the config's shapes, as TensorRT-LLM's loader checks
    # them, though the torch draft model has no modules for them (the embedded runtime refuses such a draft).
    expected |= config.dflash2_shapes
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        extra = [k for k in unexpected if k.split(".")[0] in ("embed_tokens", "lm_head")]
        hint = " (a DFlash draft shares the target's embedding and LM head and must not carry its own)" if extra else ""
        raise DFlashError(
            f"Draft weights in {path} do not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}{hint}."
        )
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise DFlashError(
                f"Draft tensor {name} has shape {shape} but its config implies {expected[name]}; "
                "the checkpoint and its config.json disagree."
            )


def check_draft(path: str | Path) -> DraftConfig:
    """Validate config and tensor names/shapes from the safetensors headers only (cheap: for build plans)."""
    path = Path(path)
    config = read_draft_config(path)
    check_checkpoint_dir(path, "Draft")  # symlinks, shard index and every header, before safetensors opens a file
    shapes = {}
    for f in _weight_files(path):
        try:
            with safe_open(f, framework="pt") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except (SafetensorError, OSError) as e:
            raise DFlashError(
                f"Draft weights {f} are not a readable safetensors file ({e}); re-export the draft."
            ) from None
    if config.is_dflash2 and "d2t" in shapes:  # TensorRT-LLM speculative/dflash.py @10e95278 (set_draft_model)
        raise DFlashError(
            "DFlash 2 candidate selection requires a shared draft/target vocab (d2t vocab mapping is not supported)."
        )
    spec = read_quant_spec(path)
    _check_names_and_shapes(path, quantized_shapes(shapes, spec) if spec is not None else shapes, config)
    return config


CARD_FILE = "training.json"  # written beside a draft by train-draft; optional in a checkpoint


def held_out_tau(path: str | Path) -> float | None:
    """The acceptance length the draft's card measured on held-out data, if it has a card that says: a hint for the
    runtime, so a missing or unreadable card is no error."""
    try:
        tau = json.loads((Path(path) / CARD_FILE).read_text())["final_metrics"]["val_tau"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(tau) if isinstance(tau, (int, float)) and tau >= 1.0 else None


def refuse_dflash2(config: DraftConfig, path: str | Path) -> None:
    """The embedded (PyTorch) runtime runs DFlash 1 drafts only: DFlashDraftModel has neither DFlash2's block
    convolutions nor its candidate selector, and running a DFlash2 draft without them would draft from the wrong
    model, so such a draft is refused where the torch model would load it; TensorRT-LLM serves it."""
    if config.is_dflash2:
        raise DFlashError(
            f"Draft {path} is a DFlash2 draft, and the embedded runtime does not run DFlash2 drafts yet; build it "
            "for TensorRT-LLM with --backend trtllm."
        )


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    path = Path(path)
    config = check_draft(path)
    refuse_dflash2(config, path)
    state = {}
    for f in _weight_files(path):
        state.update(load_file(f))
    if (spec := read_quant_spec(path)) is not None:
        return load_quantized_draft(config, state, spec, dtype, path)
    model = DFlashDraftModel(config)
    model.load_state_dict(state)
    return model.to(dtype).eval()


def save_draft(
    model: DFlashDraftModel,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write atomically: a sibling temp directory renamed into place, so readers never see half a checkpoint."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = model.config.to_dict()
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")  # transformers 5 / 4 spellings
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
