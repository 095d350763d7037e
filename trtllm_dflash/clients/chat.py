"""A conversation with the embedded engine, turn by turn: what `trtdflash chat` runs.

Each turn's prompt is the whole conversation rendered by the chat template, as the OpenAI frontend sends it, and the
turns go through a one-row engine loop (scheduler.py) whose prefix cache keeps the conversation's earlier chunks: a
turn prefills only what the cache does not hold (docs/performance.md#chat-prefix-cache). Greedy turns are the target's
own text, as everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.prefix_cache import DEFAULT_TOKENS
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.errors import DFlashError


class Conversation:
    def __init__(self, engine, system: str | None = None, prefix_cache_tokens: int = DEFAULT_TOKENS):
        if not engine.tokenizer.chat_template:
            raise DFlashError(
                "This target's tokenizer has no chat template, so a conversation cannot be rendered; use "
                "`trtdflash generate --no-chat` for plain text."
            )
        self.engine, self.system = engine, system
        self.messages: list[dict] = []
        self.dropped = 0  # turns left out of the prompt so far, the oldest first, to fit the context window
        self.scheduler = engine.scheduler(
            1, engine.target.max_positions, log=lambda m: None, prefix_cache_tokens=prefix_cache_tokens
        )

    def reset(self) -> None:
        """Start over (the prefix cache keeps what it holds: a new conversation with the same opening copies it)."""
        self.messages, self.dropped = [], 0

    def prompt_ids(self, messages: list[dict], max_new_tokens: int) -> list[int]:
        """The conversation as token ids, its oldest exchanges left out (of `messages` itself) until the prompt and the
        answer fit the window."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        room = self.engine.target.max_positions - max_new_tokens - self.engine.block_size
        while True:
            text = self.engine.tokenizer.apply_chat_template(
                head + messages, add_generation_prompt=True, tokenize=False
            )
            try:
                ids = self.engine.encode(text, chat=False)  # rendered already: as the OpenAI frontend encodes it
            except DFlashError:  # longer than the whole window
                ids = None
            if ids is not None and len(ids) <= room:
                return ids
            if len(messages) <= 1:
                raise DFlashError(
                    f"This message does not fit: with the chat template and --max-new-tokens {max_new_tokens}, "
                    f"the context window of {self.engine.target.max_positions} tokens has room for a prompt "
                    f"of {room}; shorten it."
                )
            messages[:] = messages[2:]  # the oldest exchange: a user turn and its answer
            self.dropped += 1

    def ask(
        self,
        text: str,
        *,
        max_new_tokens: int = 512,
        sampling: SamplingParams = SamplingParams(),
        stats: GenerationStats | None = None,
    ) -> Iterator[str]:
        """Yield the answer's text as it is decided; the turn joins the conversation once the answer is complete."""
        if not text.strip():
            raise DFlashError("The message is empty; type something.")
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.prompt_ids(messages, max_new_tokens)
        answer = []
        for _, delta in self.engine.stream(
            ids, max_new_tokens=max_new_tokens, sampling=sampling, stats=stats, scheduler=self.scheduler
        ):
            answer.append(delta)
            yield delta
        self.messages = messages + [{"role": "assistant", "content": "".join(answer)}]

    def close(self) -> None:
        self.scheduler.stop()

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
