"""Fill the Triton model repository template (top-level `triton_repo/`, shipped as `trtllm_dflash.triton_repo`) for one build.

The template's config.pbtxt files carry `${name}` placeholders, as Triton's TensorRT-LLM templates
do (tools/fill_template.py); paths are written relative to each model's directory so the build
output can be moved or copied as a whole.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Template

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resources import package_dir
from trtllm_dflash.serving.protocol import pbtxt_values

TEMPLATE_DIR = package_dir("triton_repo")
USER_MODEL = "ensemble"


@dataclass(frozen=True)
class RepoParams:
    """Every value the templates need; paths are relative to a model directory (triton_repo/<model>/). The engine
    model's own options are not template values: `dflash` reads config.EngineOptions from its ENGINE_FILE, and
    `tensorrt_llm` its LLM-API options from model.yaml."""

    max_batch_size: int
    max_seq_len: int
    tokenizer_dir: str
    apply_chat_template: bool
    engine_model: str = "dflash"  # the ensemble's engine step; a `tensorrt_llm` model has the same I/O
    chat_template_kwargs: str = "{}"  # JSON: the template's switches, e.g. the draft's thinking mode (deploy/lint.py)

    def models(self) -> tuple[str, ...]:
        return ("preprocessing", self.engine_model, "postprocessing", USER_MODEL)

    def values(self) -> dict[str, str]:
        """Placeholder values: these fields, and the tensor lists rendered from the wire contract (protocol.py)."""
        fields = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in asdict(self).items()}
        fields["chat_template_kwargs"] = self.chat_template_kwargs.replace("\\", "\\\\").replace('"', '\\"')  # pbtxt
        return fields | pbtxt_values()


def template_files(models: tuple[str, ...]) -> list[Path]:
    """Template files of these models relative to TEMPLATE_DIR, for the build plan: no caches or dotfiles
    (a wheel has no `.gitkeep`; emit_repository makes the version folders)."""
    if not (TEMPLATE_DIR / USER_MODEL / "config.pbtxt").is_file():
        raise DFlashError(f"The Triton repository template is missing at {TEMPLATE_DIR}; reinstall trtllm-dflash.")
    return sorted(
        rel
        for rel in (p.relative_to(TEMPLATE_DIR) for p in TEMPLATE_DIR.rglob("*") if p.is_file())
        if rel.parts[0] in models
        and "__pycache__" not in rel.parts
        and not any(part.startswith(".") for part in rel.parts)
    )


def emit_repository(dest: Path, params: RepoParams) -> list[Path]:
    """Write the filled repository into dest (which must not exist); returns the files written."""
    values = params.values()
    written, files = [], template_files(params.models())
    for model in params.models():
        (dest / model / "1").mkdir(parents=True, exist_ok=True)  # Triton needs a version folder, even an empty one
    for rel in files:
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if rel.name == "config.pbtxt":
            text = Template((TEMPLATE_DIR / rel).read_text()).safe_substitute(values)
            if "${" in text:
                raise DFlashError(
                    f"Template {rel} has a placeholder the build does not fill; the template and trtllm_dflash disagree."
                )
            out.write_text(text)
        else:
            shutil.copyfile(TEMPLATE_DIR / rel, out)
        written.append(out)
    return written
