"""What `trtdflash build` accepts (BuildOptions, checked once) and the sources it resolves and reads facts from."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.config import DTYPE_CHOICES, WEIGHTS, check_prefix_cache_tokens, check_speculation, rope_of
from trtllm_dflash.engine.prefix_cache import DEFAULT_TOKENS as PREFIX_CACHE_TOKENS
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import CARD_FILE, check_draft, refuse_dflash2
from trtllm_dflash.models.draft_ngram import FILE as NGRAM_FILE
from trtllm_dflash.models.draft_ngram import read_draft_ngram
from trtllm_dflash.models.draft_vocab import FILE as VOCAB_FILE
from trtllm_dflash.models.draft_vocab import read_draft_vocab
from trtllm_dflash.models.speculators import resolve_any_draft
from trtllm_dflash.resolve import GGUF_FILE, resolve_target, sha256_file
from trtllm_dflash.untrusted import read_hf_config
from trtllm_dflash.validate import validate_block_size, validate_pair

BACKENDS = ("torch", "trtllm")


DTYPE_BYTES = {"fp32": 4, "bf16": 2}


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


TORCH_MAX_BATCH = 8  # concurrent generations of the embedded backend by default


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
    weights: str = "auto"  # torch backend: the target's 4-bit weights as shipped where the kernel takes them (WEIGHTS)
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
    acceptance_profile: str | None = None  # trtllm: a measured speculation profile that plans the draft lengths
    replicas: int = 1  # trtllm: Dynamo workers in dynamo/ (launch.sh and the DynamoGraphDeployment)
    dynamo_mode: str = "agg"  # trtllm: Dynamo's serving mode; only aggregated serves DFlash (deploy/lint.py)

    @property
    def resolved_backend(self) -> str:
        if self.backend:
            return self.backend
        from trtllm_dflash.deploy.recipes import is_gpu_preset

        gpu_options = self.gpu or self.recipe or (self.tp or 1) > 1 or self.ep or self.quant not in (None, "none")
        return "trtllm" if gpu_options or is_gpu_preset(self.target) else "torch"

    def check(self) -> None:
        from trtllm_dflash.deploy.recipes import QUANTS

        if self.backend is not None and self.backend not in BACKENDS:
            raise DFlashError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}.")
        if self.quant is not None and self.quant not in QUANTS:
            raise DFlashError(f"--quant must be one of {', '.join(QUANTS)}, got {self.quant!r}.")
        check_prefix_cache_tokens(self.prefix_cache_tokens)
        for flag, value in (("--tp", self.tp), ("--ep", self.ep), ("--max-batch-size", self.max_batch_size)):
            if value is not None and value < 1:
                raise DFlashError(f"{flag} must be at least 1, got {value}.")
        if self.dtype not in DTYPE_CHOICES:
            raise DFlashError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}.")
        check_speculation(self.speculation)
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise DFlashError(f"--max-seq-len must be at least 2, got {self.max_seq_len}.")
        from trtllm_dflash.deploy.dynamo import DYNAMO_MODES

        if not 1 <= self.replicas <= 1024:
            raise DFlashError(f"--replicas must be in 1..1024, got {self.replicas}.")
        if self.dynamo_mode not in DYNAMO_MODES:
            raise DFlashError(f"--dynamo-mode must be one of {', '.join(DYNAMO_MODES)}, got {self.dynamo_mode!r}.")
        if self.weights not in WEIGHTS:
            raise DFlashError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}.")
        if self.weights != "auto" and self.resolved_backend != "torch":
            raise DFlashError("--weights chooses the embedded engine's weights; TensorRT-LLM takes the checkpoint's.")
        if self.acceptance_profile and (self.resolved_backend != "trtllm" or self.no_draft):
            raise DFlashError(
                "--acceptance-profile plans a TensorRT-LLM deployment's draft lengths; the embedded engine measures "
                "its own acceptance as it serves, and a --no-draft build drafts nothing."
            )
        if (self.replicas != 1 or self.dynamo_mode != "agg") and self.resolved_backend != "trtllm":
            raise DFlashError(
                "--replicas and --dynamo-mode shape a GPU deployment's dynamo/ folder; an embedded build is served "
                "as a fleet with `trtdflash serve BUILD --dynamo --workers N`."
            )
        if self.dynamo_mode != "agg" and self.no_draft:
            raise DFlashError(
                "trtdflash writes aggregated Dynamo deployments only; for disaggregated serving without a draft use "
                "Dynamo's own disagg template (dynamo/profiler/templates/dgd/trtllm/disagg.yaml)."
            )
        if self.draft is not None and self.no_draft:
            raise DFlashError("--draft and --no-draft contradict each other; pass one of them.")
        if self.draft_engine and self.no_draft:
            raise DFlashError("--draft-engine exports the draft, and --no-draft builds without one; pass one of them.")
        if self.trtllm_version is not None:
            from trtllm_dflash.deploy.trtllm.schema import release

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


def progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, disable=total < (64 << 20))


def hash_file(path: Path, cache: dict[str, str]) -> str:
    key = str(path.resolve())
    if key not in cache:
        size = path.stat().st_size
        if size >= 64 << 20:
            with progress_bar(size, f"sha256 {path.name}") as bar:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 22), b""):
                        h.update(chunk)
                        bar.update(len(chunk))
                cache[key] = h.hexdigest()
        else:
            cache[key] = sha256_file(path)
    return cache[key]


def stage(src: Path, dst: Path) -> None:
    """Hard link, or copy (with progress) when linking is impossible (another filesystem)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        with open(src, "rb") as r, open(dst, "wb") as w, progress_bar(src.stat().st_size, f"copy {src.name}") as bar:
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
                for name in st.keys():
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

    draft_dir = None if opts.no_draft else resolve_any_draft(opts.draft, opts.target)
    if draft_dir is None and not opts.no_draft:
        raise DFlashError(
            f"Target '{opts.target}' has no packaged DFlash draft (yet); pass --draft DIR, or --no-draft for a plain autoregressive build."
        )
    draft_cfg, draft_files, draft_params = None, [], 0
    if draft_dir is not None:
        draft_cfg = check_draft(draft_dir)
        if opts.resolved_backend == "torch":  # the embedded runtime would fail on it when the server starts
            refuse_dflash2(draft_cfg, draft_dir)
        if opts.draft_engine and draft_cfg.is_dflash2:
            raise DFlashError(
                f"Draft {draft_dir} is a DFlash2 draft, and --draft-engine exports the PyTorch draft model, which does "
                "not run DFlash2 drafts yet; build without --draft-engine."
            )
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
    gguf = (
        target_dir / GGUF_FILE
    )  # a preset's 4-bit weights as shipped: the embedded engine multiplies them as they are
    if opts.resolved_backend == "torch" and gguf.is_file():
        target_files.append(gguf)
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
