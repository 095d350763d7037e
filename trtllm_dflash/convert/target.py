"""Converting a Hugging Face target: ModelOpt's own HF classes and exporter, untouched."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trtllm_dflash.convert.calib import CALIB_MAX_TOKENS
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import resolve_target

AGREEMENT_SAMPLES = 1  # a sanity check (NaN, gross error): fake-quantizing FP4 weights on CPU is slow
OFFLOAD_SHARD_SIZE = "512MB"  # ModelOpt's streaming writer buffers a whole shard in RAM before writing it


class TargetJob:
    always_excluded = ("lm_head",)  # ModelOpt's presets keep the LM head high precision (`*lm_head*` disabled)
    agreement_samples = AGREEMENT_SAMPLES

    def __init__(self, opts, progress):
        self.opts = opts
        self.source = resolve_target(opts.model, progress=progress)
        self.side_files_dir = self.source
        self.config = json.loads((self.source / "config.json").read_text())
        self.offloaded = False

    def _meta_model(self):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(self.source)
            with init_empty_weights():
                return AutoModelForCausalLM.from_config(config)
        except (ValueError, OSError, KeyError) as e:
            raise DFlashError(
                f"Target {self.source} is not a causal LM transformers can build ({str(e).splitlines()[0]})."
            ) from None

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Names and shapes against the architecture built from config.json (on the meta device: no memory)."""
        model = self._meta_model()
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        missing = sorted(set(expected) - set(shapes) - tied)
        if missing:
            raise DFlashError(
                f"Target {self.source} is missing tensors its config implies: {missing[:4]}; the checkpoint is incomplete."
            )
        for name, shape in shapes.items():
            if name in expected and expected[name] != shape:
                raise DFlashError(
                    f"Target tensor {name} has shape {shape} but config.json implies {expected[name]}; the checkpoint and config disagree."
                )

    def load(self, offload_dir: Path | None = None):
        """Whole in fp32, or (`offload_dir`) with every weight on accelerate's disk offload: a module's weights are read
        when it runs and dropped after, so calibration, the agreement check and export hold one layer at a time."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.source)
        self.offloaded = offload_dir is not None
        extra = {"device_map": self._disk_map(), "offload_folder": str(offload_dir)} if self.offloaded else {}
        model = AutoModelForCausalLM.from_pretrained(self.source, dtype=torch.float32, **extra)
        return model.eval().requires_grad_(False)

    def _disk_map(self) -> dict[str, str]:
        """Each decoder layer and each other top-level module its own "disk" entry (accelerate loads per entry), except
        the input embedding (and an LM head tied to it), kept resident: ModelOpt's export builds its dummy forward's
        input on `model.device`, the first parameter's device (modelopt/torch/export/unified_export_hf.py::
        requantize_resmooth_fused_llm_layers), which must not be meta."""
        from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector

        model = self._meta_model()
        layers = LayerActivationCollector.get_decoder_layers(model)
        if layers is None:
            raise DFlashError(
                f"ModelOpt finds no decoder layers in {type(model).__name__}; convert it without --offload."
            )
        names = {id(m): n for n, m in model.named_modules()}
        layer_names = [names[id(m)] for m in layers]
        parents = {n.rpartition(".")[0] for n in layer_names}
        resident = {id(model.get_input_embeddings())}
        if model.config.get_text_config().tie_word_embeddings and model.get_output_embeddings() is not None:
            resident.add(id(model.get_output_embeddings()))
        device_map = {}

        def walk(prefix: str, module) -> None:
            for child_name, child in module.named_children():
                full = f"{prefix}{child_name}"
                if any(p == full or p.startswith(full + ".") for p in parents):
                    walk(f"{full}.", child)
                else:  # parameter-free modules (rotary inv_freq) stay too
                    device_map[full] = (
                        "cpu" if id(child) in resident or not any(True for _ in child.parameters()) else "disk"
                    )

        walk("", model)
        return device_map

    def calibration_batches(self, texts: list[str]) -> list[torch.Tensor]:
        return [
            self.tokenizer(t, return_tensors="pt", truncation=True, max_length=CALIB_MAX_TOKENS).input_ids
            for t in texts
        ]

    @staticmethod
    @torch.inference_mode()
    def run(model, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits[0]

    @staticmethod
    @torch.inference_mode()
    def feed(model, ids: torch.Tensor) -> None:
        """A calibration forward whose output is never read: layer-by-layer calibration stops it early (returns None)."""
        model(input_ids=ids, use_cache=False)

    def export(self, model, out: Path) -> dict:
        from modelopt.torch.export import export_hf_checkpoint

        dtype = getattr(torch, str(self.config.get("dtype") or self.config.get("torch_dtype") or "float32"))
        # An offloaded model takes ModelOpt's streaming writer (modelopt/torch/export/unified_export_hf_streaming.py):
        # one layer materialized at a time, shards of OFFLOAD_SHARD_SIZE instead of one model.safetensors.
        extra = {"max_shard_size": OFFLOAD_SHARD_SIZE} if self.offloaded else {}
        export_hf_checkpoint(model, dtype=dtype, export_dir=out, **extra)
        return json.loads((out / "hf_quant_config.json").read_text())
