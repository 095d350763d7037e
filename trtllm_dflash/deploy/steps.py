"""The build's unit of work: a named Step with a content key, and the steps every backend shares (staging,
the Triton templates, generated text, the target checkpoint)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from trtllm_dflash.deploy.options import Sources, stage
from trtllm_dflash.resolve import sha256_file
from trtllm_dflash.serving.repository import TEMPLATE_DIR, RepoParams, emit_repository, template_files

CALIB_SAMPLES = 64  # ModelOpt calibration prompts when the build quantizes the target


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


def stage_step(name: str, description: str, dest: str, files: list[Path], hashes: dict[str, str]) -> Step:
    planned = [PlannedFile(f"{dest}/{p.name}", p.stat().st_size, p) for p in files]

    def run(tmp: Path, progress):
        for f in planned:
            stage(f.source, tmp / f.rel)

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
            from trtllm_dflash.convert import ConvertOptions, convert_checkpoint

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
                "versions": versions(),
            },
            run,
            writes="checkpoints/target",
        )
    return [
        first,
        stage_step("tokenizer", "stage the tokenizer for pre/postprocessing", "tokenizer", src.tokenizer_files, hashes),
    ]


def versions() -> dict[str, str]:
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
