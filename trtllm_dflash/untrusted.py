"""Checks on checkpoint directories before anything loads them: their files may come from anyone.

Weights are read only as safetensors and configs only as JSON (never pickle; transformers never gets
trust_remote_code). Before a loader (transformers, safetensors, our own) opens a directory, it passes here:
every `*.safetensors` header is parsed by us (8-byte length, bounded JSON, known dtypes, shapes and offsets
that cover the data exactly once), config.json sizes are range-checked (no negative sizes, no millions of
layers), every symlink must resolve inside the model directory, and file names read from a config or a
manifest cannot leave the directory they are relative to. Each failure is one DFlashError sentence.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from trtllm_dflash.errors import DFlashError

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
MAX_JSON = 16 << 20  # config.json, index and quantization configs are kilobytes; refuse anything absurd before parsing
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
MAX_DIM = 1 << 40
# Integer config fields: (smallest, largest) allowed. The largest are far above any released model (the biggest
# have ~130 layers, 262k vocabularies, 25k hidden sizes) and far below what would exhaust memory when building one.
INT_RANGES = {
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, 1 << 27),
    "num_local_experts": (1, 1 << 14),
    "num_experts": (1, 1 << 14),
    "num_experts_per_tok": (1, 1 << 10),
    "block_size": (1, 4096),
    "num_target_layers": (1, 1024),
    "sliding_window": (0, 1 << 27),
    "mask_token_id": (0, 1 << 24),
}
POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")
NESTED = ("text_config", "dflash_config")  # sub-configs checked with the same ranges
MAX_LIST = 4096  # layer_types, target_layer_ids


# What transformers' config classes raise on values of the wrong type or shape (they are strict dataclasses).
CONFIG_ERRORS = (TypeError, ValueError, KeyError, AttributeError, StrictDataclassError)


def one_line(e: BaseException, limit: int = 160) -> str:
    """An exception's message folded into one line for a one-sentence error."""
    return " ".join(str(e).split())[:limit]


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets into the data section
    end: int


def _refuse(path, why: str):
    raise DFlashError(
        f"{path} is not a readable safetensors file ({why}); it is truncated or corrupt, so nothing was loaded: "
        "export or copy it again."
    )


def _no_duplicates(pairs):
    """A JSON object whose keys are unique: with a repeated key, parsers disagree on which value counts."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:80]!r}")
        out[k] = v
    return out


def _tensor(name, entry, path) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        _refuse(path, f"has a malformed entry for tensor {str(name)[:80]!r} in its header")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)  # noqa: E731
    if dtype not in DTYPE_BITS:
        _refuse(path, f"gives tensor {name[:80]!r} the unknown dtype {str(dtype)[:20]!r}")
    if not ints(shape) or len(shape) > 16 or any(not 0 <= d <= MAX_DIM for d in shape):
        _refuse(path, f"gives tensor {name[:80]!r} an invalid shape")
    if not ints(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        _refuse(path, f"gives tensor {name[:80]!r} invalid data offsets")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        _refuse(
            path,
            f"says tensor {name[:80]!r} ({dtype} {shape}) takes {offsets[1] - offsets[0]} bytes, which its shape contradicts",
        )
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype, shape, offsets, after checking that the header is sane and describes the file exactly."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                _refuse(path, f"is {size} bytes long, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or n < 2:
                _refuse(path, f"declares a {n}-byte header, where safetensors allows 2 bytes to 100 MB")
            if 8 + n > size:
                _refuse(path, f"declares a {n}-byte header but holds only {size - 8} bytes after the length")
            raw = f.read(n)
    except OSError as e:
        raise DFlashError(f"Cannot read {path} ({e.strerror}).") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _refuse(path, f"has a header that is not valid JSON ({str(e)[:80]})")
    if not raw.startswith(b"{") or not isinstance(header, dict):
        _refuse(path, "has a header that is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        _refuse(path, "has __metadata__ that is not an object of strings")
    tensors = {name: _tensor(name, entry, path) for name, entry in header.items()}
    expected = 0  # tensors must tile the data section: no gaps, no overlaps, nothing after the last
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != expected:
            _refuse(
                path, f"has tensor {name[:80]!r} at byte {t.start} where {expected} was expected, a gap or an overlap"
            )
        expected = t.end
    if expected != size - 8 - n:
        _refuse(path, f"has {size - 8 - n} bytes of tensor data but its header describes {expected}")
    return tensors


def read_json(path: str | Path, what: str = "config") -> dict:
    """A JSON object from a checkpoint (bounded size, UTF-8, no duplicate keys), or one sentence saying why not."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON + 1)
    except OSError as e:
        raise DFlashError(f"Cannot read the {what} {path} ({e.strerror}).") from None
    if len(raw) > MAX_JSON:
        raise DFlashError(f"The {what} {path} is larger than {MAX_JSON >> 20} MB; it is not a checkpoint config.")
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DFlashError(
            f"The {what} {path} is not readable JSON ({str(e)[:80]}); re-export the checkpoint."
        ) from None
    if not isinstance(value, dict):
        raise DFlashError(f"The {what} {path} is not a JSON object; re-export the checkpoint.")
    return value


def check_config_values(config: dict, where: str | Path) -> None:
    """Range-check the sizes a loader allocates from (top level, text_config, dflash_config); None means the default."""
    for scope, cfg in [("", config)] + [(f"{k}.", config[k]) for k in NESTED if isinstance(config.get(k), dict)]:
        for key, (lo, hi) in INT_RANGES.items():
            value = cfg.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise DFlashError(
                    f"{where} sets {scope}{key} to {json.dumps(value)[:40]}, outside {lo}..{hi}; the config is corrupt."
                )
        for key in POSITIVE_FLOATS:
            value = cfg.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
            ):
                raise DFlashError(
                    f"{where} sets {scope}{key} to {json.dumps(value)[:40]}; it must be a positive finite number."
                )
        for key in ("layer_types", "target_layer_ids"):
            value = cfg.get(key)
            if value is not None and (not isinstance(value, list) or len(value) > MAX_LIST):
                raise DFlashError(
                    f"{where} sets {scope}{key} to something other than a list of at most {MAX_LIST} entries."
                )
        ids = cfg.get("target_layer_ids") or []
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1024 for i in ids):
            raise DFlashError(f"{where} has {scope}target_layer_ids outside 0..1023; the config is corrupt.")


def inside(path: str | Path, root: str | Path) -> Path:
    """`root / path` for a relative path from a config or manifest; refused if it is absolute, climbs with `..`,
    or resolves (through symlinks) outside `root`."""
    root = Path(root).resolve()
    if not isinstance(path, str) or not path or "\0" in path:
        raise DFlashError(
            f"A path in the files of {root} is not a non-empty string ({str(path)[:60]!r}); they were edited or are corrupt."
        )
    rel = Path(path)
    if rel.is_absolute() or ".." in rel.parts:
        raise DFlashError(f"The path {path[:120]!r} in the files of {root} leaves that directory; it was refused.")
    full = (root / rel).resolve()
    if not full.is_relative_to(root):
        raise DFlashError(
            f"The path {path[:120]!r} in the files of {root} resolves to {full}, outside that directory; it was refused."
        )
    return root / rel


def link_root(model_dir: Path) -> Path:
    """Where the symlinks of a model directory may point: the directory itself, or for a Hugging Face cache
    snapshot (<repo>/snapshots/<rev>/, whose files link to <repo>/blobs/) the repository folder."""
    model_dir = model_dir.resolve()
    return model_dir.parent.parent if model_dir.parent.name == "snapshots" else model_dir


def check_links(model_dir: Path) -> None:
    """Every symlink under the directory resolves inside it (a checkpoint cannot make us read /etc/shadow), and every
    entry is a regular file or a directory (a FIFO or a device named like a weight file would block or never end)."""
    root = link_root(model_dir)
    for dirpath, dirnames, filenames in os.walk(
        model_dir
    ):  # followlinks=False: linked directories are checked, not entered
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink() and not p.resolve().is_relative_to(root):
                raise DFlashError(
                    f"{p} is a symlink to {os.readlink(p)}, outside the model directory {model_dir}; it was refused."
                )
            try:
                mode = p.stat().st_mode
            except OSError:
                raise DFlashError(f"{p} is a broken symlink or cannot be read; fix or remove it.") from None
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise DFlashError(f"{p} is not a regular file (a FIFO, socket or device); it was refused.")


def check_checkpoint_dir(path: str | Path, what: str = "Checkpoint") -> None:
    """Everything a loader will read from `path`, checked before it reads anything: symlinks, config.json,
    the shard index, quantization configs and every safetensors header."""
    path = Path(path)
    if not path.is_dir():
        raise DFlashError(f"{what} {path} is not a directory; pass the folder holding config.json and *.safetensors.")
    check_links(path)
    if not (path / "config.json").is_file():
        raise DFlashError(f"{what} {path} has no config.json; pass a Hugging Face model folder.")
    check_config_values(read_json(path / "config.json"), path / "config.json")
    weights = set(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise DFlashError(f"The shard index {index} has no weight_map object; re-export the checkpoint.")
        for shard in set(weight_map.values()):
            if not str(shard).endswith(".safetensors") or not inside(shard, path).is_file():
                raise DFlashError(
                    f"The shard index {index} names {str(shard)[:120]!r}, which is not a safetensors file in {path}."
                )
            weights.add(path / shard)
    for name in ("hf_quant_config.json", "quantization.json"):
        if (path / name).is_file():
            read_json(path / name, "quantization config")
    if not weights:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise DFlashError(
                f"{what} {path} holds pickle weights ({', '.join(pickles[:3])}); only safetensors are loaded, because "
                "pickles can run code: convert it with safetensors.torch.save_file first."
            )
        raise DFlashError(f"{what} {path} has no *.safetensors weights.")
    for w in sorted(weights):
        read_safetensors_header(w)


def read_hf_config(path: str | Path, what: str = "Target"):
    """transformers' config of a checked directory, without custom code (trust_remote_code stays off); a config it
    cannot parse is one sentence."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, *CONFIG_ERRORS) as e:
        raise DFlashError(
            f"{what} {path} has a config transformers cannot read without custom code ({one_line(e)})."
        ) from None
