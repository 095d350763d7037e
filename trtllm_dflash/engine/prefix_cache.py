"""Automatic prefix caching: the K/V and draft features of prompt chunks seen before, copied into any later prompt that
starts with the same tokens (vLLM's automatic prefix caching, SGLang's radix cache), so a conversation resent whole
each turn (the OpenAI API's way), or many prompts behind one long system message, prefill only what is new.

A prompt is prefilled in canonical chunks: the chat template's head (text.shared_prefix) when it starts with it,
then blocks of BLOCK tokens counted from there, each in a forward of its own. A chunk's K/V then has the same bits
whether this prompt computed it or another's did (attention rounds by its chunk), so what a request writes never
depends on what ran before it. An entry is keyed by a hash chained over every chunk up to its own (vLLM's block
hashes: a chunk's key commits to all tokens before it); the least recently used go first once the entries pass
their token budget. The head's entry is pinned: every chat request starts with it.

A `CacheListener` hears every entry kept and dropped, on the engine thread: a Dynamo worker publishes them as KV
events, so its router sends a prompt to the replica that holds its prefix (serving/dynamo_worker.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the build imports the default budget without loading torch
    import torch

BLOCK = 64  # prompt tokens per prefill forward after the head: the unit the cache keeps
DEFAULT_TOKENS = 8192  # a server's budget (SmolLM2 in bf16: about 27 KB a token with the draft's features, 220 MB)


def chunk_ends(n: int, head: int) -> list[int]:
    """Where the canonical chunks of an n-token prompt end: the head (head > 0: the prompt starts with it), then
    every BLOCK tokens from there, the last chunk whatever is left."""
    ends = [head] if head else []
    end = head
    while end < n:
        end = min(end + BLOCK, n)
        ends.append(end)
    return ends


def chunk_keys(tokens: list[int], ends: list[int]) -> list[bytes]:
    """One key per chunk, each a hash of the previous key and the chunk's tokens: equal keys, equal prefixes."""
    keys, key, start = [], b"", 0
    for end in ends:
        key = hashlib.blake2b(key + array("q", tokens[start:end]).tobytes(), digest_size=16).digest()
        keys.append(key)
        start = end
    return keys


@dataclass
class Entry:
    keys: list[torch.Tensor]  # per target layer [nkv, tokens, hd]
    values: list[torch.Tensor]
    features: torch.Tensor | None  # [tokens, n_sel*H]: the draft's context features (None without a draft)

    @property
    def tokens(self) -> int:
        return self.keys[0].shape[1]


class CacheListener(Protocol):
    def stored(self, key: bytes, prompt: Sequence[int], start: int, end: int) -> None:
        """Entry `key` now holds positions [start, end) of `prompt` (its key commits to prompt[:end])."""

    def removed(self, key: bytes) -> None:
        """Entry `key` is gone."""


class PrefixCache:
    def __init__(self, max_tokens: int, listener: CacheListener | None = None):
        self.max_tokens, self.listener = max_tokens, listener
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self.pinned: dict[bytes, Entry] = {}
        self.tokens = 0  # held by `entries` (pinned ones not counted)

    def get(self, key: bytes) -> Entry | None:
        if key in self.pinned:
            return self.pinned[key]
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def __contains__(self, key: bytes) -> bool:
        return key in self.pinned or key in self.entries

    def put(self, key: bytes, entry: Entry, pin: bool = False, prompt: Sequence[int] = (), end: int = 0) -> None:
        """Keep `entry` under `key`: positions [end - entry.tokens, end) of `prompt` (what the listener hears)."""
        if key in self:
            return
        if not pin:
            if entry.tokens > self.max_tokens:
                return
            while self.tokens + entry.tokens > self.max_tokens:
                old_key, old = self.entries.popitem(last=False)
                self.tokens -= old.tokens
                if self.listener is not None:
                    self.listener.removed(old_key)
            self.entries[key] = entry
            self.tokens += entry.tokens
        else:
            self.pinned[key] = entry
        if self.listener is not None:
            self.listener.stored(key, prompt, end - entry.tokens, end)
