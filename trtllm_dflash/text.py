"""Text in and out of the engine: prompts as token ids (the chat template), and token ids back as streamed text.

Below the engine and the serving layer alike: Triton's preprocessing and postprocessing models use it without loading
a model, and the engine's runtime and the TensorRT-LLM model's steps detokenize with the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trtllm_dflash.errors import DFlashError

MIN_SHARED_PREFIX = 4  # tokens: a BOS alone is not worth a forward of its own


class IncrementalDetokenizer:
    """Text deltas that are correct under streaming: no split multi-byte characters, no lost spaces.

    Decodes a short window of tokens around the boundary (the vLLM prefix/read offset scheme), and
    holds back text that may still become a stop string.
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything decoded so far (before stop-string truncation)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        elif final:
            self.text += full[len(prefix) :]
        for s in self.stop_strings:
            i = self.text.find(s)
            if i >= 0:
                self.text, self.stopped = self.text[:i], True
        safe = len(self.text)
        if not (final or self.stopped):
            for s in self.stop_strings:  # hold back a tail that could still grow into a stop string
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        safe = min(safe, len(self.text) - k)
                        break
        delta = self.text[self.emitted : safe]
        self.emitted = safe
        return delta


def encode_prompt(
    tokenizer, prompt: str, chat: bool, max_positions: int, template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """Prompt text -> token ids (chat template if the tokenizer has one); shared with Triton's preprocessing model.
    `template_kwargs`: the template's own switches (a deployment renders prompts in its draft's thinking mode)."""
    if not isinstance(prompt, str) or not prompt:
        raise DFlashError("The prompt is empty; pass some text.")
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
        )
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
    else:  # text a frontend rendered with the chat template already starts with BOS: do not add a second one
        bos = tokenizer.bos_token
        ids = tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]
    if len(ids) >= max_positions:
        raise DFlashError(f"The prompt is {len(ids)} tokens, but the context window is {max_positions}; shorten it.")
    return list(ids)


def shared_prefix(tokenizer, max_positions: int) -> list[int]:
    """The tokens every chat prompt starts with (the template's head: a system prompt, the user turn's opening), or []
    where there is no chat template or the head is too short to matter: what a server prefills once (Batch)."""
    if not tokenizer.chat_template:
        return []
    try:
        a, *others = [
            encode_prompt(tokenizer, text, True, max_positions) for text in ("Hello", "1 + 2 = ?", "¿Qué tal?")
        ]
    except Exception:  # a template that refuses a lone user turn: no shared head, requests still say what is wrong
        return []
    n = 0
    while n < len(a) and all(n < len(o) and o[n] == a[n] for o in others):
        n += 1
    return a[:n] if n >= MIN_SHARED_PREFIX else []
