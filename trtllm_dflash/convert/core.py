"""`convert_checkpoint`: a target or a DFlash draft -> a ModelOpt unified-HF quantized checkpoint, atomically."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from trtllm_dflash.atomic import locked, recover, replace_dir
from trtllm_dflash.config import is_draft_architecture
from trtllm_dflash.convert.calib import CALIB_MAX_TOKENS, CALIB_SOURCES, calibration_texts
from trtllm_dflash.convert.formats import FORMATS, KV_CACHE_FORMATS, QuantFormat
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import PRESETS, preset_for
from trtllm_dflash.untrusted import check_checkpoint_dir, check_links, read_json

ROLES = ("target", "draft")
CARD = "quantization.json"
# Everything a runtime needs besides config + weights; ModelOpt's export writes neither tokenizer nor chat template.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _read_config(path: Path) -> dict:
    check_links(path)
    return read_json(path / "config.json")


@dataclass(frozen=True)
class ConvertOptions:
    """What to convert and how; validated once here, so the conversion itself never meets a bad option."""

    model: str  # preset name, local HF target dir, or DFlash draft dir
    quant: str
    output: Path
    role: str | None = None  # None: a draft dir is detected from its architectures
    kv_cache_quant: str = "none"
    calib_data: str = "gsm8k"
    calib_samples: int = 64
    exclude: tuple[str, ...] = ()
    target: str | None = (
        None  # a draft's target (features + embedding for calibration); default from training.json / preset
    )
    offload: bool | None = None  # target layer by layer from disk; None: when the fp32 model would not fit in RAM

    def __post_init__(self):
        if self.quant not in FORMATS:
            raise DFlashError(f"Unknown --quant '{self.quant}'; choose one of {', '.join(FORMATS)}.")
        if self.kv_cache_quant not in KV_CACHE_FORMATS:
            raise DFlashError(
                f"Unknown --kv-cache-quant '{self.kv_cache_quant}'; choose one of {', '.join(KV_CACHE_FORMATS)}."
            )
        if self.role not in (None, *ROLES):
            raise DFlashError(f"Unknown --role '{self.role}'; choose target or draft.")
        if self.calib_samples < 1:
            raise DFlashError(f"--calib-samples must be at least 1 (got {self.calib_samples}).")
        if self.calib_data not in CALIB_SOURCES and not Path(self.calib_data).is_file():
            raise DFlashError(
                f"--calib-data '{self.calib_data}' is neither {', '.join(CALIB_SOURCES)} nor an existing file."
            )
        object.__setattr__(self, "output", Path(self.output).expanduser())
        object.__setattr__(self, "exclude", tuple(self.exclude))
        path = Path(self.model).expanduser()
        if not path.is_dir() and preset_for(self.model) is None:
            raise DFlashError(
                f"--model '{self.model}' is neither a local directory nor a preset ({', '.join(PRESETS)})."
            )
        if path.is_dir() and not (path / "config.json").is_file():
            raise DFlashError(
                f"--model {path} has no config.json; pass a Hugging Face model folder, a DFlash draft folder or a preset."
            )
        if path.is_dir():
            is_draft = is_draft_architecture(_read_config(path).get("architectures") or [])  # DFlash2 too
            if self.role is None:
                object.__setattr__(self, "role", "draft" if is_draft else "target")
            elif (self.role == "draft") != is_draft:
                raise DFlashError(
                    f"--model {path} is {'a DFlash draft' if is_draft else 'not a DFlash draft'}, but --role is {self.role}."
                )
            if path.resolve() == self.output.resolve():
                raise DFlashError(
                    f"--output {self.output} is the source model itself; write the quantized checkpoint elsewhere."
                )
        elif self.role is None:
            object.__setattr__(self, "role", "target")
        if self.role == "draft" and self.kv_cache_quant != "none":
            raise DFlashError(
                "--kv-cache-quant is for targets: the draft's attention has no KV-cache quantizer to calibrate yet."
            )
        if self.role == "draft" and self.offload:
            raise DFlashError("--offload is for targets: a draft is a few layers and is always converted whole.")
        if self.role == "draft" and not path.is_dir() and preset_for(self.model).default_draft is None:
            raise DFlashError(f"Preset '{self.model}' ships no draft; pass a draft directory as --model.")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


OFFLOAD_RAM_FACTOR = (
    1.5  # the whole-model path peaked at 1.3x the fp32 weights (8.8 GB for Qwen2.5-Coder-1.5B's 6.7 GB)
)


def _available_ram() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _offload(opts: ConvertOptions, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Layer by layer when asked, or when the whole fp32 model (with the whole path's overhead) exceeds free RAM.
    Both paths write the same tensors (tests/test_convert.py), so the automatic choice never changes the output."""
    if opts.offload is not None or opts.role == "draft":
        return bool(opts.offload)
    return OFFLOAD_RAM_FACTOR * 4 * sum(math.prod(s) for s in shapes.values()) > _available_ram()


def _check_output(opts: ConvertOptions, source: Path) -> None:
    """Only an empty dir or an earlier conversion of the same source may be replaced: never another model."""
    out = opts.output
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--output {out} is a file; pass a directory path.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    card = out / CARD
    try:
        same = card.is_file() and json.loads(card.read_text()).get("source", {}).get("path") == str(source.resolve())
    except (OSError, json.JSONDecodeError):
        same = False
    if not same:
        raise DFlashError(f"--output {out} already holds other files (another model?); pass a new or empty directory.")


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{path} has no safetensors weights; only safetensors checkpoints can be converted.")
    return files


CHECK_CHUNK_BYTES = 64 << 20  # NaN/Inf check block


def _read_blocks(f: Path, name: str, shape: tuple[int, ...]) -> Iterable[torch.Tensor]:
    """`name` in row blocks of at most CHECK_CHUNK_BYTES, the file reopened for each: safetensors maps the file, and
    every page an open mapping has touched counts in RSS until it closes (one `safe_open` over a whole 7 GB
    checkpoint peaked at 7 GB), so only one block is ever resident however large the tensor."""
    if not shape:
        with safe_open(f, framework="pt") as st:
            yield st.get_tensor(name)
        return
    step = max(1, CHECK_CHUNK_BYTES // (8 * math.prod(shape[1:])))  # 8 bytes: the widest element
    for start in range(0, shape[0], step):
        with safe_open(f, framework="pt") as st:
            yield st.get_slice(name)[start : start + step]


def check_source_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Every source tensor finite, read a block at a time (a checkpoint larger than RAM is never resident); returns shapes."""
    shapes = {}
    for f in _weight_files(path):
        try:
            with safe_open(f, framework="pt") as st:
                found = {name: tuple(st.get_slice(name).get_shape()) for name in st.keys()}
            for name, shape in found.items():
                for t in _read_blocks(f, name, shape):
                    if t.is_floating_point() and not torch.isfinite(t).all():
                        bad = (~torch.isfinite(t)).sum().item()
                        raise DFlashError(
                            f"Source tensor {name} in {f.name} has {bad} NaN/Inf values; fix the checkpoint before quantizing."
                        )
                shapes[name] = shape
        except (SafetensorError, OSError) as e:
            raise DFlashError(f"{f} is not a readable safetensors file ({e}).") from None
    return shapes


def _quant_cfg(fmt: QuantFormat, kv: str, exclude: Iterable[str], layerwise: bool = False) -> dict:
    """ModelOpt preset + FP8 KV + our exclusions; FP4 block quantizers routed to the CPU backend.

    `layerwise` (an offloaded model): ModelOpt's layer-by-layer max calibration (modelopt/torch/quantization/
    model_calib.py::layerwise_calibrate) materializes one decoder layer at a time and feeds it the inputs captured
    from the previous layer's full-precision forward (`get_qdq_activations_from_prev_layer` False), the activations
    a whole-model max calibration sees. `calib_mutates_weights` False: max only sets amax, and its write-back would
    pin every disk-offloaded layer in a CPU dict (plugins/accelerate.py::_writeback_params_to_weights_map)."""
    import modelopt.torch.quantization as mtq

    from trtllm_dflash.convert.cpu_backend import register

    entries = [dict(e) for e in getattr(mtq, fmt.modelopt_cfg)["quant_cfg"]]
    if fmt.weight_scale_bits is not None:
        backend = register()
        for e in entries:
            if isinstance(e.get("cfg"), dict) and (e["cfg"].get("block_sizes") or {}).get("type") == "dynamic":
                e["cfg"] = {**e["cfg"], "backend": backend}
    if KV_CACHE_FORMATS[kv]:
        entries += getattr(mtq, KV_CACHE_FORMATS[kv])["quant_cfg"]
    entries += [{"quantizer_name": f"{p}.*", "enable": False} for p in exclude]
    # "max" also for the MXFP4 presets (algorithm None): W4A8 needs a calibrated static FP8 input_scale.
    if layerwise:
        return {
            "quant_cfg": entries,
            "algorithm": {"method": "max", "layerwise": {"enable": True, "calib_mutates_weights": False}},
        }
    return {"quant_cfg": entries, "algorithm": "max"}


def _linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _check_exclude_and_shapes(
    model: torch.nn.Module, fmt: QuantFormat, exclude: tuple[str, ...], always_excluded: tuple[str, ...]
) -> None:
    names = _linear_names(model)
    for p in exclude:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise DFlashError(
                f"--exclude '{p}' matches no Linear module (they are named like {names[0]!r}); fix the pattern."
            )
    if fmt.group_size is None:
        return
    for n in names:
        m = model.get_submodule(n)
        if any(fnmatch.fnmatchcase(n, p) for p in (*exclude, *always_excluded)):
            continue
        if m.in_features % fmt.group_size:
            raise DFlashError(
                f"{fmt.name} quantizes blocks of {fmt.group_size} input features, but {n} has {m.in_features}; "
                f"choose fp8 or --exclude '{n}'."
            )


@torch.inference_mode()
def _agreement(model, batches, reference: list[torch.Tensor], run) -> float:
    """Top-1 agreement of the fake-quantized model (CPU backend) with the unquantized one on the calibration samples."""
    hits = total = 0
    for batch, ref in zip(batches, reference):
        out = run(model, batch)
        hits += (out.argmax(-1) == ref.argmax(-1)).sum().item()
        total += ref.shape[:-1].numel()
        if not torch.isfinite(out).all():
            raise DFlashError(
                "The quantized model produces NaN/Inf on the calibration data; exclude the offending layers."
            )
    return hits / total


def convert_checkpoint(
    opts: ConvertOptions,
    progress: Callable[[str], None] = print,
    track: Callable[[Iterable, str], Iterable] = lambda it, desc: it,
) -> Path:
    """Quantize `opts.model` into `opts.output`; `track(iterable, desc)` wraps the calibration loop (a progress bar)."""
    started = time.time()
    fmt = FORMATS[opts.quant]
    if opts.role == "draft":
        from trtllm_dflash.convert.draft import DraftJob as Job
    else:
        from trtllm_dflash.convert.target import TargetJob as Job
    job = Job(opts, progress)
    check_checkpoint_dir(job.source, opts.role.capitalize())  # before any reader opens the source's files
    _check_output(opts, job.source)
    progress(f"Checking every tensor of {job.source} for NaN/Inf...")
    shapes = check_source_tensors(job.source)
    job.check(shapes)
    offload = _offload(opts, shapes)
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    offload_dir = opts.output.with_name(
        f".{opts.output.name}.offload{os.getpid()}"
    )  # next to the output: never a tmpfs
    with locked(opts.output, "conversion"):  # a second conversion into the same output is refused, not interleaved
        if leftovers := recover(opts.output):
            progress(f"Cleaned up after an interrupted conversion into {opts.output}: {', '.join(leftovers)}.")
        try:
            return _convert(opts, job, fmt, offload, offload_dir, started, progress, track)
        finally:
            shutil.rmtree(offload_dir, ignore_errors=True)


def _convert(opts, job, fmt: QuantFormat, offload: bool, offload_dir: Path, started: float, progress, track) -> Path:
    import modelopt

    if offload:
        progress("Loading the target layer by layer from disk (accelerate disk offload).")
    model = job.load(offload_dir) if offload else job.load()
    _check_exclude_and_shapes(model, fmt, opts.exclude, job.always_excluded)

    texts = calibration_texts(opts.calib_data, opts.calib_samples)
    batches = job.calibration_batches(texts)
    reference = [job.run(model, b) for b in batches[: job.agreement_samples]]

    import modelopt.torch.quantization as mtq

    progress(
        f"Calibrating {fmt.name} on {len(batches)} {opts.calib_data} samples (CPU, fp32{', layer by layer' if offload else ''})..."
    )
    exclude = (*opts.exclude, *job.always_excluded)

    def forward_loop(m):  # layer by layer, ModelOpt replays it per layer and shows its own progress bar
        for b in batches if offload else track(batches, "calibrating"):
            (job.feed if offload else job.run)(m, b)

    model = mtq.quantize(model, _quant_cfg(fmt, opts.kv_cache_quant, exclude, layerwise=offload), forward_loop)
    agreement = _agreement(model, batches[: job.agreement_samples], reference, job.run)

    tmp = opts.output.with_name(f".{opts.output.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        progress(f"Exporting to {opts.output}...")
        hf_quant = job.export(model, tmp)
        for name in SIDE_FILES:
            src = job.side_files_dir / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
        card = {
            "format": fmt.name,
            "quant_algo": hf_quant["quantization"]["quant_algo"],
            "kv_cache_quant_algo": hf_quant["quantization"].get("kv_cache_quant_algo"),
            "role": opts.role,
            "source": {"model": opts.model, "path": str(job.source.resolve())},
            "calibration": {
                "data": opts.calib_data,
                "samples": len(batches),
                "max_tokens": CALIB_MAX_TOKENS,
                "top1_agreement_fake_quant": round(agreement, 4),
            },
            "excluded_modules": hf_quant["quantization"].get("exclude_modules", []),
            "exclude_patterns": list(opts.exclude),
            "offload": offload,
            "modelopt_version": modelopt.__version__,
            "torch_version": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.time() - started, 1),
            "peak_rss_mb": round(_peak_rss_mb(), 1),
        }
        (tmp / CARD).write_text(json.dumps(card, indent=2) + "\n")
        replace_dir(tmp, opts.output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(
        f"Wrote {fmt.quant_algo} checkpoint to {opts.output} (top-1 agreement {agreement:.3f}, peak RSS {card['peak_rss_mb']:.0f} MB)."
    )
    return opts.output
