"""Prompt lookup: guesses copied from the request's own tokens, for rows where the text repeats itself.

When the last few committed tokens occurred earlier (in the prompt or the answer so far), the tokens that followed
them then are a free guess for what follows now: no forward pass makes it. Small targets loop and lists repeat
their scaffolding, which is where the DFlash draft, seeing the context only through the target's features, is
weakest. The guesses are verified like the draft's, so output is unchanged. This is vLLM's `ngram` method
(`prompt_lookup_min`/`prompt_lookup_max`) and Hugging Face's `prompt_lookup_num_tokens`; here it runs beside the
draft: a row with lookup guesses verifies them instead of drafting, and the block policy chooses how many.
"""

from __future__ import annotations

# Suffix lengths matched, longest first: 3-6 beat 2-4 on math and code replays and cost little on chat
# (docs/performance.md#lookup-suffix-lengths).
MIN_NGRAM, MAX_NGRAM = 3, 6
# Guesses a row may verify at once, beyond the draft's block: a loop, once matched, tends to go on for a long while, and
# there every guess is accepted. 31 keeps a verify at 32 tokens; the block policy prices every length, so a row verifies
# that many only where its lookups have been paying, and in bf16 on a CPU with AMX a batch keeps them within its exact
# kernel's rows (Batch.max_guesses). The replays behind it: docs/performance.md#lookup-guesses.
MAX_GUESSES = 31


class NgramIndex:
    """The tokens of one request, and for every n-gram (MIN_NGRAM..MAX_NGRAM tokens) the position right after its
    latest occurrence whose following token is known."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = list(tokens)
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # tokens[:_indexed] are indexed: the rest when a proposal needs them

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of the sequence seen before (latest occurrence)."""
        seq, nxt = self.tokens, self._next
        for end in range(self._indexed, len(seq)):  # every n-gram ending just before `end` has a known successor
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                nxt[tuple(seq[end - n : end])] = end
        self._indexed = len(seq)
        for n in range(min(MAX_NGRAM, len(seq)), MIN_NGRAM - 1, -1):
            at = nxt.get(tuple(seq[-n:]))
            if at is not None:
                return seq[at : at + limit]
        return []
