"""Converting a DFlash draft: ModelOpt has no DFlash class, so the draft's own module tree (z-lab tensor names:
fc, hidden_norm, layers.N.*, norm) is quantized and exported with ModelOpt's transformers exporter core
(`_export_transformers_checkpoint`, modelopt/torch/export/unified_export_hf.py in 0.47.0), which also unifies the
q/k/v and gate/up scales through its dummy forward, as TensorRT-LLM's fused QKV / gate-up GEMMs need."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from trtllm_dflash.convert.calib import CALIB_MAX_TOKENS, DRAFT_ANCHORS
from trtllm_dflash.convert.formats import SCALE_SUFFIXES
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import check_draft, load_draft, read_draft_config
from trtllm_dflash.models.draft import DFlashDraftModel
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import DRAFTS_DIR, preset_for, resolve_target

AGREEMENT_SAMPLES = 1  # a sanity check (NaN, gross error): fake-quantizing FP4 weights on CPU is slow


class CalibDraft(DFlashDraftModel):
    """The draft with one forward over (target features, block embeddings), the shape ModelOpt's calibration and
    export dummy-forward call. Context K/V also pass through k_proj/v_proj here: at inference the context rows are
    projected by those same Linears, so their input quantizers must see the context features too."""

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def get_dummy_inputs(self) -> dict:
        c = self.config
        return {
            "target_hidden": torch.zeros(1, 2, self.fc.in_features, device=self.device),
            "noise_embedding": torch.zeros(1, c.block_size, c.hidden_size, device=self.device),
        }

    def forward(self, target_hidden, noise_embedding):
        start, b = target_hidden.shape[1], noise_embedding.shape[1]
        ctx = self.project_context(target_hidden)
        for layer in self.layers:
            layer.self_attn.k_proj(ctx)
            layer.self_attn.v_proj(ctx)
        ctx_k, ctx_v = self.context_kv(ctx, torch.arange(start, device=ctx.device)[None])
        positions = torch.arange(start, start + b, device=ctx.device)[None]
        return self.draft_block(noise_embedding, positions, ctx_k, ctx_v, torch.tensor([start], device=ctx.device))


class DraftJob:
    always_excluded = ("fc",)  # the context projection stays high precision (brief: the draft's fc unless asked)
    agreement_samples = AGREEMENT_SAMPLES

    def __init__(self, opts, progress):
        self.opts, self.progress = opts, progress
        path = Path(opts.model).expanduser()
        self.source = path if path.is_dir() else DRAFTS_DIR / preset_for(opts.model).default_draft
        self.side_files_dir = self.source
        target = opts.target or self._recorded_target(path)
        if target is None:
            raise DFlashError(
                f"Draft {self.source} does not name its target (no training.json); pass --target PRESET_OR_DIR for calibration."
            )
        self.target_dir = resolve_target(target, progress=progress)

    def _recorded_target(self, path: Path) -> str | None:
        if not path.is_dir():
            return self.opts.model  # a preset's own draft
        card = self.source / "training.json"
        try:
            return json.loads(card.read_text()).get("target") if card.is_file() else None
        except (OSError, json.JSONDecodeError):
            return None

    def check(self, shapes) -> None:
        self.config = check_draft(self.source)  # names and shapes against config.json (DFlashError on mismatch)

    def load(self):
        self.target = TargetModel.load(self.target_dir)
        if self.target.hidden_size != self.config.hidden_size:
            raise DFlashError(
                f"Draft hidden size {self.config.hidden_size} does not match target {self.target_dir} ({self.target.hidden_size}); pass its own --target."
            )
        model = CalibDraft(self.config)
        model.load_state_dict(load_draft(self.source).state_dict())
        return model.eval().requires_grad_(False)

    def calibration_batches(self, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(target features [1, T, n*H], token ids [1, T]) per text; the target runs once, unquantized."""
        out = []
        tok = self.target.tokenizer
        with torch.inference_mode(), self.target.tapped(self.config.target_layer_ids) as features:
            for t in texts:
                ids = tok(t, return_tensors="pt", truncation=True, max_length=CALIB_MAX_TOKENS).input_ids
                if ids.shape[1] < 2:
                    continue
                self.target.model(input_ids=ids, use_cache=False)
                out.append((features().clone(), ids))
        if not out:
            raise DFlashError("Calibration texts are too short for draft calibration (under two tokens each).")
        return out

    @torch.inference_mode()
    def run(self, model, batch) -> torch.Tensor:
        """Draft logits for DRAFT_ANCHORS blocks spread over the sample: [anchors, block, vocab]."""
        feats, ids = batch
        c, T = self.config, ids.shape[1]
        anchors = sorted({max(1, (T - 1) * (k + 1) // (DRAFT_ANCHORS + 1)) for k in range(DRAFT_ANCHORS)})
        logits = []
        for a in anchors:
            block = torch.full((1, c.block_size), c.mask_token_id)
            block[0, 0] = ids[0, a]
            hidden = model(
                target_hidden=feats[:, :a], noise_embedding=model.embed_block(self.target.embed_tokens, block)
            )
            logits.append(model.compute_logits(hidden, self.target.lm_head)[0])
        return torch.stack(logits)

    def export(self, model, out: Path) -> dict:
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
        from modelopt.torch.export.unified_export_hf import _export_transformers_checkpoint

        raw = json.loads((self.source / "config.json").read_text())
        dtype = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"))
        state, hf_quant = _export_transformers_checkpoint(model, dtype)
        # Calibration ran in fp32; high-precision tensors go back to the draft's own dtype, scales stay fp32.
        state = {
            k: (v.to(dtype) if v.dtype == torch.float32 and not k.endswith(SCALE_SUFFIXES) else v).contiguous()
            for k, v in state.items()
        }
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        raw["quantization_config"] = convert_hf_quant_config_format(hf_quant)
        (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
        read_draft_config(out)  # still a loadable DFlash config
        return hf_quant
