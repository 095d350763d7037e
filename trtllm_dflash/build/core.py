"""`trtdflash build`: target + draft -> a self-contained, servable output directory.

The build is a list of named steps planned up front (so `--dry-run` can print it) and run into a
temporary sibling directory that is renamed into place at the end. Each step has a key (a hash of
its inputs, source content hashes included); a step whose key matches the previous build's manifest
and whose outputs are intact is reused instead of redone. Backends contribute their own steps: the
embedded `torch` backend stages checkpoints and fills the Triton repository; a TensorRT-LLM backend
adds conversion / quantization / tensor-parallel sharding steps in the same list.

Layout of the output (paths in the Triton configs are relative, so the directory can be moved):
    manifest.json             what was built from what (sources + hashes, options, versions, steps)
    checkpoints/target/       target HF checkpoint (weights hard-linked from the source when possible)
    checkpoints/draft/        DFlash draft (z-lab format)
    tokenizer/                tokenizer files for pre/postprocessing
    triton_repo/              preprocessing, dflash, postprocessing, ensemble
Weights are hard links when source and output share a filesystem (no extra disk, and the output
stays valid if the source cache is deleted), otherwise copies; never symlinks, which would break
when the source moves.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path

from ..atomic import locked, recover, replace_dir
from ..config import DTYPE_CHOICES, SPECULATION, rope_of
from ..errors import DFlashError
from ..models.checkpoint import CARD_FILE, check_draft
from ..models.draft_ngram import FILE as NGRAM_FILE
from ..models.draft_ngram import read_draft_ngram
from ..models.draft_vocab import FILE as VOCAB_FILE
from ..models.draft_vocab import read_draft_vocab
from ..prefix_cache import DEFAULT_TOKENS as PREFIX_CACHE_TOKENS
from ..repository import TEMPLATE_DIR, RepoParams, emit_repository, template_files
from ..resolve import PRESETS, preset_for, resolve_draft, resolve_target, sha256_file
from ..untrusted import inside, read_hf_config
from ..validate import validate_block_size, validate_pair

BACKENDS = ("torch", "trtllm")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "hf_quant_config.json",
    "quantization.json",
)  # the last two: a ModelOpt export (trtdflash convert)
RUNTIME_OVERHEAD = 600 << 20  # torch + tritonserver + 3 python backend stubs, measured RSS on CPU (rounded up)
TORCH_MAX_BATCH = 8  # concurrent generations of the embedded backend by default
CALIB_SAMPLES = 64  # ModelOpt calibration prompts when the build quantizes the target


@dataclass(frozen=True)
class BuildOptions:
    """Everything `trtdflash build` accepts; checked once in `check()`. None means: the recipe's (trtllm) or the
    embedded default (torch)."""

    output: Path
    target: str = "smollm2-135m"
    draft: str | None = None
    no_draft: bool = False
    backend: str | None = None  # None: trtllm for a GPU preset or any GPU option (--gpu, --tp > 1, --ep, --quant)
    gpu: str | None = None
    recipe: str | None = None  # latency | throughput, where the preset has both
    tp: int | None = None
    ep: int | None = None
    quant: str | None = None
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    block_size: int | None = None
    dtype: str = "auto"  # resolved to fp32 or bf16 for this CPU when the build starts
    speculation: str = "adaptive"  # torch backend: block length per step from measured costs, or fixed
    lookup: bool = True  # torch backend: verify prompt-lookup guesses where the text repeats (lookup.py)
    int8_draft: bool = True  # torch backend, bf16 on AVX2 alone: the draft's weights as int8 (DFlashEngine.load)
    prefix_cache_tokens: int = PREFIX_CACHE_TOKENS  # torch backend: prompt tokens kept for prompts that start alike
    chat_template: bool = True
    force: bool = False  # write a TensorRT-LLM plan that does not fit the GPUs
    draft_engine: bool = (
        False  # also the ONNX drafter (attention = TensorRT plugin node) and, with TensorRT, its engine
    )
    trtllm_version: str | None = None  # trtllm: the TensorRT-LLM release whose fields and validators the options meet
    opt_in: tuple[
        str, ...
    ] = ()  # trtllm: combinations upstream has not tested with DFlash, taken anyway (recipes.OPT_INS)

    @property
    def resolved_backend(self) -> str:
        if self.backend:
            return self.backend
        from .trtllm_backend import is_gpu_preset

        gpu_options = self.gpu or self.recipe or (self.tp or 1) > 1 or self.ep or self.quant not in (None, "none")
        return "trtllm" if gpu_options or is_gpu_preset(self.target) else "torch"

    def check(self) -> None:
        from .recipes import QUANTS

        if self.backend is not None and self.backend not in BACKENDS:
            raise DFlashError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}.")
        if self.quant is not None and self.quant not in QUANTS:
            raise DFlashError(f"--quant must be one of {', '.join(QUANTS)}, got {self.quant!r}.")
        if self.prefix_cache_tokens < 0:
            raise DFlashError(f"--prefix-cache-tokens must be 0 (off) or more, got {self.prefix_cache_tokens}.")
        for flag, value in (("--tp", self.tp), ("--ep", self.ep), ("--max-batch-size", self.max_batch_size)):
            if value is not None and value < 1:
                raise DFlashError(f"{flag} must be at least 1, got {value}.")
        if self.dtype not in DTYPE_CHOICES:
            raise DFlashError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}.")
        if self.speculation not in SPECULATION:
            raise DFlashError(f"--speculation must be one of {', '.join(SPECULATION)}, got {self.speculation!r}.")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise DFlashError(f"--max-seq-len must be at least 2, got {self.max_seq_len}.")
        if self.draft is not None and self.no_draft:
            raise DFlashError("--draft and --no-draft contradict each other; pass one of them.")
        if self.draft_engine and self.no_draft:
            raise DFlashError("--draft-engine exports the draft, and --no-draft builds without one; pass one of them.")
        if self.trtllm_version is not None:
            from ..backends.trtllm.schema import release

            release(self.trtllm_version)  # one sentence naming the releases there are
        if self.resolved_backend == "torch":
            gpu_flags = [
                f
                for f, v in (
                    ("--gpu", self.gpu),
                    ("--recipe", self.recipe),
                    ("--ep", self.ep),
                    ("--trtllm-version", self.trtllm_version),
                )
                if v
            ] + (["--tp"] if (self.tp or 1) > 1 else [])
            if gpu_flags:
                raise DFlashError(
                    f"The torch backend runs one model copy on one CPU device; {gpu_flags[0]} needs "
                    "--backend trtllm (or drop it)."
                )
            if self.quant == "mxfp4":
                raise DFlashError(
                    "The torch backend runs fp8 and nvfp4 checkpoints; for MXFP4 use --backend trtllm (gpt-oss ships it)."
                )


@dataclass
class Sources:
    """Resolved, validated inputs and the facts the plan needs (read from configs and safetensors headers)."""

    target_dir: Path
    draft_dir: Path | None
    target_files: list[Path]
    tokenizer_files: list[Path]
    draft_files: list[Path]
    block_size: int
    max_seq_len: int
    target_params: int
    draft_params: int
    kv_bytes_per_token: int  # target + draft, in the build dtype


@dataclass
class PlannedFile:
    rel: str
    size: int
    source: Path | None = None  # staged (linked/copied) from here; None = generated


@dataclass
class Step:
    """One named unit of work; `key` changes whenever anything it reads changes."""

    name: str
    description: str
    files: list[PlannedFile]
    key_inputs: dict
    run: Callable[[Path, Callable[[str], None]], None]
    writes: str | None = None  # a folder whose files are known only after the run (a ModelOpt export)
    dirs: tuple[str, ...] = ()  # folders it makes that may hold no file (Triton's version folders): kept on reuse
    key: str = field(init=False)

    def __post_init__(self):
        self.key = hashlib.sha256(json.dumps(self.key_inputs, sort_keys=True, default=str).encode()).hexdigest()

    def outputs(self, tmp: Path) -> list[PlannedFile]:
        if self.writes is None:
            return self.files
        return [
            PlannedFile(str(f.relative_to(tmp)), f.stat().st_size)
            for f in sorted((tmp / self.writes).rglob("*"))
            if f.is_file()
        ]


@dataclass
class Plan:
    options: BuildOptions
    sources: Sources | None  # None: a TensorRT-LLM preset whose weights the GPU host fetches
    steps: list[Step]
    hashes: dict[str, str]  # source path -> sha256
    deployment: object | None = None  # trtllm_backend.Deployment for the TensorRT-LLM backend

    @property
    def backend(self) -> str:
        return "torch" if self.deployment is None else "trtllm"

    def memory_estimate(self) -> dict[str, int]:
        """Bytes per device: the TensorRT-LLM plan per GPU, or for the torch backend the weights in the build
        dtype + a full KV cache per concurrent request + the prefix cache's K/V + runtime."""
        if self.deployment is not None:
            m = self.deployment.memory
            return {label: b for label, b in m.rows} | {"total": m.total_bytes, "gpu_memory": m.gpu_memory_bytes}
        b = DTYPE_BYTES[self.options.dtype]
        s = self.sources
        kv = s.kv_bytes_per_token * s.max_seq_len * self.max_batch_size
        prefix = s.kv_bytes_per_token * self.options.prefix_cache_tokens
        return {
            "weights": (s.target_params + s.draft_params) * b,
            "kv_cache": kv,
            "prefix_cache": prefix,
            "runtime": RUNTIME_OVERHEAD,
            "total": (s.target_params + s.draft_params) * b + kv + prefix + RUNTIME_OVERHEAD,
        }

    @property
    def max_batch_size(self) -> int:
        return (
            self.deployment.recipe.max_batch_size
            if self.deployment
            else (self.options.max_batch_size or TORCH_MAX_BATCH)
        )


def _progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, disable=total < (64 << 20))


def _hash(path: Path, cache: dict[str, str]) -> str:
    key = str(path.resolve())
    if key not in cache:
        size = path.stat().st_size
        if size >= 64 << 20:
            with _progress_bar(size, f"sha256 {path.name}") as bar:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 22), b""):
                        h.update(chunk)
                        bar.update(len(chunk))
                cache[key] = h.hexdigest()
        else:
            cache[key] = sha256_file(path)
    return cache[key]


def _stage(src: Path, dst: Path) -> None:
    """Hard link, or copy (with progress) when linking is impossible (another filesystem)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        with open(src, "rb") as r, open(dst, "wb") as w, _progress_bar(src.stat().st_size, f"copy {src.name}") as bar:
            for chunk in iter(lambda: r.read(1 << 22), b""):
                w.write(chunk)
                bar.update(len(chunk))
        shutil.copystat(src, dst)


def _safetensors_facts(files: list[Path]) -> tuple[int, dict[str, tuple[int, ...]]]:
    """(parameter count, name -> shape) from safetensors headers, without reading the weights."""
    from safetensors import safe_open

    n, shapes = 0, {}
    for f in files:
        try:
            with safe_open(f, "pt") as st:
                for name in st:
                    shape = tuple(st.get_slice(name).get_shape())
                    shapes[name] = shape
                    n += math.prod(shape)
        except Exception as e:
            raise DFlashError(f"{f} is not a readable safetensors file ({e}); re-export the checkpoint.") from None
    return n, shapes


def resolve_sources(opts: BuildOptions, progress: Callable[[str], None]) -> Sources:
    """Resolve names to directories and check that target, tokenizer and draft fit together."""
    target_dir = resolve_target(opts.target, progress)
    weights = sorted(target_dir.glob("*.safetensors"))
    if not weights:
        raise DFlashError(
            f"Target {target_dir} has no *.safetensors weights; only safetensors checkpoints are built (pickles can run code)."
        )
    tok_files = [target_dir / n for n in TOKENIZER_FILES if (target_dir / n).is_file()]
    names = {p.name for p in tok_files}
    if not ({"tokenizer.json", "tokenizer.model"} & names or {"vocab.json", "merges.txt"} <= names):
        raise DFlashError(
            f"Target {target_dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json + merges.txt); add it to the folder."
        )
    config = read_hf_config(target_dir)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    target_params, shapes = _safetensors_facts(weights)
    embed = [s for n, s in shapes.items() if n.endswith("embed_tokens.weight")]
    vocab_rows = embed[0][0] if embed else int(text.vocab_size)
    hidden, n_layers = int(text.hidden_size), int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    max_positions = int(getattr(text, "max_position_embeddings", 0) or 1 << 30)
    b = DTYPE_BYTES[opts.dtype]
    kv_per_token = 2 * n_layers * kv_heads * head_dim * b

    draft_dir = None if opts.no_draft else resolve_draft(opts.draft, opts.target)
    if draft_dir is None and not opts.no_draft:
        raise DFlashError(
            f"Target '{opts.target}' has no packaged DFlash draft (yet); pass --draft DIR, or --no-draft for a plain autoregressive build."
        )
    draft_cfg, draft_files, draft_params = None, [], 0
    if draft_dir is not None:
        draft_cfg = check_draft(draft_dir)
        draft_weights = sorted(draft_dir.glob("*.safetensors"))
        if not draft_weights:
            raise DFlashError(f"Draft checkpoint {draft_dir} has no model.safetensors.")
        # the card, the draft vocabulary and the n-gram prior (all optional) travel with the draft: the card's held-out tau
        # guides the server's probes; the other two are checked here, so a bad one fails the build, not the server
        read_draft_vocab(draft_dir, vocab_rows)
        read_draft_ngram(draft_dir, vocab_rows)
        draft_files = (
            [draft_dir / "config.json"]
            + draft_weights
            + [
                draft_dir / n
                for n in ("model.safetensors.index.json", CARD_FILE, VOCAB_FILE, NGRAM_FILE)
                if (draft_dir / n).is_file()
            ]
        )
        draft_params, _ = _safetensors_facts(draft_weights)
        validate_pair(
            draft_cfg, hidden_size=hidden, num_layers=n_layers, vocab_rows=vocab_rows, rope_parameters=rope_of(text)
        )
        kv_per_token += 2 * draft_cfg.num_hidden_layers * draft_cfg.num_key_value_heads * draft_cfg.head_dim * b
    if opts.block_size is not None and opts.block_size > 1 and draft_cfg is None:
        raise DFlashError(f"--block-size {opts.block_size} needs a draft; drop --no-draft or use --block-size 1.")
    block = validate_block_size(opts.block_size, draft_cfg)
    max_seq_len = opts.max_seq_len or max_positions
    if max_seq_len > max_positions:
        raise DFlashError(
            f"--max-seq-len {max_seq_len} exceeds the target's context window {max_positions}; use at most {max_positions}."
        )
    target_files = [target_dir / n for n in CONFIG_FILES if (target_dir / n).is_file()] + weights + tok_files
    return Sources(
        target_dir,
        draft_dir,
        target_files,
        tok_files,
        draft_files,
        block,
        max_seq_len,
        target_params,
        draft_params,
        kv_per_token,
    )


def stage_step(name: str, description: str, dest: str, files: list[Path], hashes: dict[str, str]) -> Step:
    planned = [PlannedFile(f"{dest}/{p.name}", p.stat().st_size, p) for p in files]

    def run(tmp: Path, progress):
        for f in planned:
            _stage(f.source, tmp / f.rel)

    inputs = {f.rel: hashes[str(f.source)] for f in planned}
    return Step(name, description, planned, inputs, run)


def template_step(params: RepoParams) -> Step:
    """The Triton repository of the build's engine model, filled from the templates."""
    templates = template_files(params.models())
    template_hashes = {str(t): sha256_file(TEMPLATE_DIR / t) for t in templates}
    return Step(
        "triton_repo",
        f"fill the Triton model repository ({', '.join(params.models())})",
        [PlannedFile(f"triton_repo/{t}", (TEMPLATE_DIR / t).stat().st_size) for t in templates],
        {"values": params.values(), "templates": template_hashes},  # values include the tensor lists of protocol.py
        lambda tmp, progress: emit_repository(tmp / "triton_repo", params),
        dirs=tuple(f"triton_repo/{m}/1" for m in params.models()),
    )


def text_step(name: str, description: str, files: dict[str, str], executable: tuple[str, ...] = ()) -> Step:
    """Generated text files, rendered at plan time (so --dry-run shows their sizes and the key covers their content)."""

    def run(tmp: Path, progress):
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
            if rel in executable:
                (tmp / rel).chmod(0o755)

    return Step(name, description, [PlannedFile(rel, len(text.encode())) for rel, text in files.items()], files, run)


def target_steps(src: Sources, quant: str | None, hashes: dict[str, str]) -> list[Step]:
    """checkpoints/target (staged, or quantized with ModelOpt when `quant` asks for a format it is not in) + tokenizer."""
    if quant is None:
        first = stage_step(
            "target_checkpoint",
            "stage the target HF checkpoint (hard links)",
            "checkpoints/target",
            src.target_files,
            hashes,
        )
    else:

        def run(tmp: Path, progress):
            from ..convert import ConvertOptions, convert_checkpoint

            convert_checkpoint(
                ConvertOptions(
                    model=str(src.target_dir),
                    quant=quant,
                    output=tmp / "checkpoints/target",
                    calib_samples=CALIB_SAMPLES,
                ),
                progress,
            )

        first = Step(
            "quantize_target",
            f"quantize the target to {quant} with ModelOpt (trtdflash convert; {CALIB_SAMPLES} GSM8K "
            "calibration samples)",
            [],
            {
                "sources": {str(p): hashes[str(p)] for p in src.target_files},
                "quant": quant,
                "calib_samples": CALIB_SAMPLES,
                "versions": _versions(),
            },
            run,
            writes="checkpoints/target",
        )
    return [
        first,
        stage_step("tokenizer", "stage the tokenizer for pre/postprocessing", "tokenizer", src.tokenizer_files, hashes),
    ]


def _torch_steps(opts: BuildOptions, src: Sources, hashes: dict[str, str]) -> list[Step]:
    steps = target_steps(src, opts.quant if opts.quant not in (None, "none") else None, hashes)
    if src.draft_dir is not None:
        steps.append(
            stage_step(
                "draft_checkpoint",
                "stage the DFlash draft (z-lab format)",
                "checkpoints/draft",
                src.draft_files,
                hashes,
            )
        )
    steps.append(
        template_step(
            RepoParams(
                max_batch_size=opts.max_batch_size or TORCH_MAX_BATCH,
                max_seq_len=src.max_seq_len,
                block_size=src.block_size,
                dtype=opts.dtype,
                target_dir="../../checkpoints/target",
                draft_dir="../../checkpoints/draft" if src.draft_dir else "",
                tokenizer_dir="../../tokenizer",
                apply_chat_template=opts.chat_template,
                speculation=opts.speculation,
                lookup=opts.lookup,
                int8_draft=opts.int8_draft,
                prefix_cache_tokens=opts.prefix_cache_tokens,
            )
        )
    )
    return steps


def _hash_sources(src: Sources | None, progress) -> dict[str, str]:
    hashes: dict[str, str] = {}
    if src is not None:
        progress("Hashing sources...")
        for p in src.target_files + src.draft_files:
            hashes[str(p)] = _hash(p, hashes)
    return hashes


def make_plan(opts: BuildOptions, progress: Callable[[str], None] = print) -> Plan:
    opts.check()
    if opts.dtype == "auto":  # the build records the dtype it chose, so a build moved to another CPU keeps it
        from ..cpu import resolve_dtype

        opts = replace(opts, dtype=resolve_dtype(opts.dtype))
    if opts.resolved_backend == "trtllm":
        from . import trtllm_backend

        deployment, src = trtllm_backend.plan_deployment(opts, progress, resolve_sources)
        hashes = _hash_sources(src, progress)
        steps = trtllm_backend.steps(opts, deployment, src, hashes)
        return Plan(
            opts,
            src,
            steps + _draft_engine_steps(opts, src, hashes, deployment.recipe.max_batch_size, progress),
            hashes,
            deployment,
        )
    if not Path(opts.target).expanduser().is_dir() and preset_for(opts.target) is None:
        from .recipes import presets

        raise DFlashError(
            f"Unknown target {opts.target!r}: it is neither a local directory, an embedded preset ({', '.join(PRESETS)}) "
            f"nor a GPU preset ({', '.join(presets())}); models are never downloaded at build time."
        )
    src = resolve_sources(opts, progress)
    hashes = _hash_sources(src, progress)
    steps = _torch_steps(opts, src, hashes) + _draft_engine_steps(
        opts, src, hashes, opts.max_batch_size or TORCH_MAX_BATCH, progress
    )
    return Plan(opts, src, steps, hashes)


def _draft_engine_steps(
    opts: BuildOptions, src: Sources | None, hashes: dict[str, str], max_batch: int, progress
) -> list[Step]:
    if not opts.draft_engine:
        return []
    from . import draft_engine

    return draft_engine.steps(opts, src, hashes, max_batch, progress)


def _versions() -> dict[str, str]:
    out = {}
    for pkg in (
        "trtllm-dflash",
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "nvidia-pytriton",
        "tritonclient",
    ):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _header(plan: Plan) -> list[str]:
    o, s = plan.options, plan.sources
    if plan.deployment is not None:
        d = plan.deployment
        r, p = d.recipe, d.recipe.parallel
        return [
            f"Build plan -> {o.output} (backend trtllm, recipe {r.id}: {r.num_gpus} x {r.gpu.upper()}, tp {p.tp}, pp {p.pp}, "
            f"ep {p.ep}, attention-dp {'on' if p.attention_dp else 'off'}, quant {r.quant}, KV cache {r.kv_cache_dtype})",
            f"  target  {r.weights if not d.local else s.target_dir}"
            + ("" if d.local else "  (fetched on the GPU host)"),
            f"  draft   {d.draft_ref or 'none (autoregressive)'}"
            + (f", {r.max_draft_len} draft tokens per step" if d.draft_ref else ""),
            f"  max_batch_size {r.max_batch_size}, max_seq_len {r.max_seq_len}, max_num_tokens {r.max_num_tokens}",
        ]
    return [
        f"Build plan -> {o.output} (backend torch, dtype {o.dtype})",
        f"  target  {s.target_dir} ({s.target_params / 1e6:.1f}M params)",
        f"  draft   {s.draft_dir or 'none (autoregressive)'}"
        + (f" ({s.draft_params / 1e6:.1f}M params)" if s.draft_dir else ""),
        f"  block size {s.block_size}, max_seq_len {s.max_seq_len}, max_batch_size {plan.max_batch_size}",
    ]


def describe(plan: Plan) -> str:
    """Human-readable plan for --dry-run."""
    s = plan.sources
    what = (
        "target, draft and tokenizer fit together"
        if plan.deployment is None
        else "recipe, parallel layout, draft vs target, memory plan and every LLM-API option"
    )
    lines = _header(plan) + ["Steps:", f"  1. resolve_and_validate: {what} (done)"]
    for i, step in enumerate(plan.steps, 2):
        lines.append(f"  {i}. {step.name}: {step.description} [{_fmt(sum(f.size for f in step.files))}]")
        for f in step.files:
            lines.append(f"       {f.rel}  {_fmt(f.size)}" + ("  (link or copy)" if f.source else ""))
    lines.append(f"  {len(plan.steps) + 2}. manifest: write {MANIFEST}")
    if plan.deployment is not None:
        lines.append(plan.deployment.memory.describe())
        return "\n".join(lines)
    mem = plan.memory_estimate()
    lines.append(
        f"Estimated memory per device (cpu, 1 device): {_fmt(mem['total'])} = weights {_fmt(mem['weights'])} + "
        f"KV cache {_fmt(mem['kv_cache'])} ({plan.max_batch_size} x {s.max_seq_len} tokens) + prefix cache "
        f"{_fmt(mem['prefix_cache'])} ({plan.options.prefix_cache_tokens} tokens) + runtime {_fmt(mem['runtime'])}"
    )
    return "\n".join(lines)


def _sources_manifest(plan: Plan) -> dict:
    s, d = plan.sources, plan.deployment
    if s is None:  # a preset the GPU host fetches
        return {"target": {"hf_id": d.target_ref}, "draft": None if d.draft_ref is None else {"hf_id": d.draft_ref}}
    return {
        "target": {"path": str(s.target_dir), "files": {p.name: plan.hashes[str(p)] for p in s.target_files}},
        "draft": None
        if s.draft_dir is None
        else {"path": str(s.draft_dir), "files": {p.name: plan.hashes[str(p)] for p in s.draft_files}},
    }


def _resolved(plan: Plan) -> dict:
    if plan.deployment is None:
        s = plan.sources
        return {
            "block_size": s.block_size,
            "max_seq_len": s.max_seq_len,
            "memory_estimate_bytes": plan.memory_estimate(),
        }
    r, m = plan.deployment.recipe, plan.deployment.memory
    return {
        "recipe": r.id,
        "gpu": r.gpu,
        "num_gpus": r.num_gpus,
        "block_size": r.max_draft_len + 1,
        "max_seq_len": r.max_seq_len,
        "max_batch_size": r.max_batch_size,
        "memory_plan_bytes_per_gpu": plan.memory_estimate(),
        "fits": m.fits,
        "max_batch_size_that_fits": m.max_batch_size_that_fits,
    }


def _read_manifest(out: Path) -> dict | None:
    """The manifest, checked (None if there is none or it is not JSON): it is read back from disk, so it is input like
    any other, and every path in it must stay inside the build."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None

    def damaged(why: str):
        raise DFlashError(f"{out / MANIFEST} is damaged or was edited ({why}); delete {out} and build it again.")

    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        damaged(
            f"format {manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {MANIFEST_FORMAT}"
        )
    serve, steps = manifest.get("serve"), manifest.get("steps")
    resolved, options = manifest.get("resolved"), manifest.get("options")
    if not isinstance(serve, dict) or not isinstance(serve.get("model"), str):
        damaged("serve.model is missing")
    if not (
        isinstance(resolved, dict)
        and isinstance(resolved.get("max_seq_len"), int)
        and isinstance(options, dict)
        and isinstance(options.get("target"), str)
    ):
        damaged("resolved.max_seq_len or options.target is missing")
    inside(serve.get("model_repository"), out)
    if not isinstance(steps, dict) or not all(
        isinstance(s, dict) and isinstance(s.get("outputs"), dict) for s in steps.values()
    ):
        damaged("steps are malformed")
    for step in steps.values():
        for rel, meta in step["outputs"].items():
            inside(rel, out)
            if not isinstance(meta, dict) or not isinstance(meta.get("size"), int):
                damaged(f"{rel} has no size")
    return manifest


def _reusable(step: Step, old: dict | None, out: Path) -> bool:
    """The previous build ran this step with the same inputs and its outputs are still there, same sizes."""
    prev = (old or {}).get("steps", {}).get(step.name)
    if not prev or prev.get("key") != step.key:
        return False
    return all(
        (out / rel).is_file() and (out / rel).stat().st_size == meta["size"] for rel, meta in prev["outputs"].items()
    ) and all((out / rel).is_dir() for rel in step.dirs)


def run_build(opts: BuildOptions, progress: Callable[[str], None] = print, dry_run: bool = False) -> Path:
    """Plan, then build atomically under an exclusive lock on the output; returns the output directory.

    Killed at any point (SIGINT, SIGKILL), the output is the previous complete build or absent; the next run
    removes what the killed one left beside it. A second build of the same output at once is refused."""
    out = Path(opts.output).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--output {out} is a file; pass a directory path.")
    if dry_run:
        return _build(opts, out, progress, dry_run=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out):
        if leftovers := recover(out):
            progress(f"Cleaned up after an interrupted build of {out}: {', '.join(leftovers)}.")
        return _build(opts, out, progress, dry_run=False)


def _build(opts: BuildOptions, out: Path, progress: Callable[[str], None], dry_run: bool) -> Path:
    old = _read_manifest(out) if out.is_dir() else None
    if out.is_dir() and old is None and any(out.iterdir()):
        raise DFlashError(
            f"--output {out} exists and is not a trtdflash build (no {MANIFEST}); pick a new directory or remove it."
        )
    plan = make_plan(opts, progress)
    if dry_run:
        progress(describe(plan))
        return out
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(plan.options).items()} | {
        "output": str(out),
        "backend": plan.backend,
    }
    reuse = {step.name: _reusable(step, old, out) for step in plan.steps}
    if (
        old
        and all(reuse.values())
        and {s.name for s in plan.steps} == set(old.get("steps", {}))
        and old.get("options") == options
    ):
        progress(f"{out} is up to date (same inputs, outputs intact); nothing to do.")
        return out

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        steps_meta = {}
        for i, step in enumerate(plan.steps, 1):
            t0 = time.perf_counter()
            if reuse[step.name]:
                progress(f"[{i}/{len(plan.steps)}] {step.name}: unchanged, reusing the previous output")
                for rel in old["steps"][step.name]["outputs"]:
                    _stage(out / rel, tmp / rel)
                for rel in step.dirs:
                    (tmp / rel).mkdir(parents=True, exist_ok=True)
            else:
                progress(f"[{i}/{len(plan.steps)}] {step.name}: {step.description}...")
                step.run(tmp, progress)
            outputs = {}
            for f in step.outputs(tmp):
                p = tmp / f.rel
                sha = plan.hashes[str(f.source)] if f.source else sha256_file(p)
                outputs[f.rel] = {"size": p.stat().st_size, "sha256": sha}
            steps_meta[step.name] = {"key": step.key, "outputs": outputs, "seconds": round(time.perf_counter() - t0, 3)}
        manifest = {
            "format": MANIFEST_FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": _versions(),
            "options": options,
            "sources": _sources_manifest(plan),
            "resolved": _resolved(plan),
            "serve": {"model_repository": "triton_repo", "model": "ensemble", "backend": plan.backend},
            "steps": steps_meta,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(
        f"Built {out} ({len(plan.steps)} steps, {sum(not r for r in reuse.values())} run, {sum(reuse.values())} reused)."
    )
    return out


def read_build(out: Path) -> dict:
    """The manifest of a finished build; what `serve` checks before starting Triton."""
    out = Path(out).expanduser()
    manifest = _read_manifest(out)
    if manifest is None:
        raise DFlashError(
            f"{out} is not a trtdflash build output (no readable {MANIFEST}); run `trtdflash build --output {out}` first."
        )
    return manifest
