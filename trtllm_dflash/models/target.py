"""The target: any Hugging Face causal LM, with hidden-state taps and a croppable KV cache."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..errors import DFlashError
from ..config import rope_of
from .quantized import load_quantized_lm, read_quant_spec

RECURRENT_HINTS = ("mamba", "rwkv", "recurrent", "linear_attention", "gated_deltanet", "xlstm")


class TargetModel:
    """Wraps an HF causal LM; `forward` returns logits and the features of the tapped layers.

    Layer id l is the *output* of decoder layer l (HF hidden_states[l + 1]); captured with forward
    hooks so no other layer's states are kept.
    """

    def __init__(self, model: nn.Module, tokenizer, path: Path):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.config = model.config
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.text_config = text_cfg
        self.layers = model.get_decoder().layers
        self.num_layers = len(self.layers)
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()  # untied heads exist (Qwen2.5 GGUFs)
        self.hidden_size = self.embed_tokens.weight.shape[1]
        self.vocab_rows = self.embed_tokens.weight.shape[0]
        self.max_positions = int(getattr(text_cfg, "max_position_embeddings", 0) or 1 << 30)
        self.dtype = self.embed_tokens.weight.dtype
        self._taps: list[int] = []
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self._capture = False

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "TargetModel":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        path = Path(path)
        try:
            config = AutoConfig.from_pretrained(path)  # never trust_remote_code implicitly
        except (ValueError, OSError, KeyError) as e:
            raise DFlashError(f"Target {path} has a config transformers cannot read without custom code ({str(e).splitlines()[0]}).") from None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kinds = " ".join([str(getattr(text, "model_type", ""))] + [str(t) for t in (getattr(text, "layer_types", None) or [])]).lower()
        if any(h in kinds for h in RECURRENT_HINTS):
            raise DFlashError(
                f"Target {path} ({text.model_type}) has recurrent/linear-attention layers whose state cannot be cropped "
                "after a rejected draft; only attention-only targets are supported for now."
            )
        try:
            spec = read_quant_spec(path)
            model = (load_quantized_lm(path, config, spec, dtype) if spec is not None
                     else AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa"))
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (ValueError, OSError) as e:
            raise DFlashError(f"Could not load target {path}: {str(e).splitlines()[0]}") from None
        model.eval().requires_grad_(False)
        return cls(model, tokenizer, path)

    @property
    def rope_parameters(self) -> dict:
        return rope_of(self.text_config)

    def set_taps(self, layer_ids: list[int]) -> None:
        """Register hooks on the decoder layers whose outputs the draft reads."""
        for h in self._hooks:
            h.remove()
        self._taps = list(layer_ids)
        self._hooks = [self.layers[l].register_forward_hook(self._make_hook(l)) for l in set(layer_ids)]

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self._capture:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        cache.activate_past_recording()  # sliding-window layers must be able to roll back rejected drafts
        return cache

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keep the first `length` positions (transformers 5 crops by a negative count to remove)."""
        remove = cache.get_seq_length() - length
        if remove > 0:
            cache.crop(-remove)

    @contextmanager
    def _capturing(self, enabled: bool):
        """Record the tapped layers' outputs in the forwards inside; yields `features()` -> [b, T, n_sel*H] of the last one, or None."""
        self._capture = enabled and bool(self._taps)
        try:
            yield lambda: torch.cat([self._captured[l] for l in self._taps], dim=-1) if self._capture else None
        finally:
            self._capture = False
            self._captured.clear()

    @contextmanager
    def tapped(self, layer_ids: list[int]):
        """Capture `layer_ids` in forwards run outside `forward` (the data phase's own loop); the taps are restored after."""
        previous = self._taps
        self.set_taps(layer_ids)
        try:
            with self._capturing(True) as features:
                yield features
        finally:
            self.set_taps(previous)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int, cache, capture: bool, logits_to_keep: int = 0):
        """input_ids [b, T] at positions start..start+T-1 -> logits [b, T|keep, V], features [b, T, n_sel*H] or None."""
        positions = torch.arange(start, start + input_ids.shape[1]).expand(input_ids.shape[0], -1)
        with self._capturing(capture) as features:
            out = self.model(
                input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep,
            )
            return out.logits, features()
