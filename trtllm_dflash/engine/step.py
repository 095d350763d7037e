"""One speculative step's data: the per-row plan its phases fill in, the acceptance rule, and the record it leaves.

A step runs four phases over the ready rows (batch.py, `Batch.step`): plan (each row's block length, and whether its
guesses come from prompt lookup or the draft) -> propose (propose.py) -> verify (one target forward for every row)
-> accept (`accept`, per row) -> commit. Each phase reads and writes `RowPlan`s, so each can be run and tested alone,
and a new source of guesses touches the propose phase only.

`StepRecord` is the one account of a step. The per-request statistics (`GenerationStats.add_step`), the engine's
metrics (`EngineMetrics.add_step`, which the Triton model publishes to Prometheus) and the block policy
(`BlockPolicy.observe`) all read it; none of them re-derives what the step did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtllm_dflash.engine.request import Request
from trtllm_dflash.engine.sampling import rejection_sample, sampling_probs


@dataclass
class RowPlan:
    """One row's part of a step. Invariants: 1 <= k; len(guesses) == k - 1 once proposed; a sampled row's `q` is the
    distribution its guesses were drawn from ([k - 1, V]; a lookup guess is all mass on itself); 0 <= accepted <= k - 1
    and `bonus` is the target's token after the accepted guesses once accepted."""

    req: Request
    k: int  # tokens verified: the pending token and k - 1 guesses (1: plain decoding)
    looked: bool = False  # the guesses are prompt lookup's (lookup.py), not the draft's
    found: list[int] = field(default_factory=list)  # lookup's candidates, of which the first k - 1 are verified
    spare: bool = False  # a greedy drafting row also drafts the slot after its block (never verified; see `beyond`)
    guesses: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    spare_guess: int | None = None
    accepted: int = 0
    bonus: int = -1
    beyond: bool | None = None  # where every guess was accepted: whether the spare guess equals the bonus token

    @property
    def drafting(self) -> bool:
        return self.k > 1 and not self.looked


def accept(plan: RowPlan, logits: torch.Tensor, posterior: torch.Tensor) -> None:
    """The guesses the target takes, and its next token. Greedy: the longest prefix of guesses equal to the target's
    argmax (`posterior`, [k]), whose next argmax is the bonus token, so the output is the target's token for token.
    Sampled: rejection sampling against the target's distribution from `logits` ([k, V]), which keeps the output
    distributed as the target's (sampling.rejection_sample)."""
    r, k = plan.req, plan.k
    if r.sampling.greedy:
        post = posterior.tolist()
        a = 0
        while a < k - 1 and plan.guesses[a] == post[a]:
            a += 1
        bonus = post[a]
    else:
        q = plan.q if plan.q is not None else torch.empty(0, 0)
        a, bonus = rejection_sample(
            torch.tensor(plan.guesses, dtype=torch.long), sampling_probs(logits, r.sampling), q, r.gen
        )
    plan.accepted, plan.bonus = a, bonus
    if plan.spare_guess is not None and a == k - 1:
        plan.beyond = plan.spare_guess == bonus


@dataclass(frozen=True)
class StepRecord:
    """What one step did, row by row (row i is slot i), and what it cost."""

    ks: tuple[int, ...]  # block length per row
    accepted: tuple[int, ...]  # guesses accepted per row
    draft_seconds: float = 0.0  # the propose phase
    verify_seconds: float = 0.0  # verify, accept and commit
    looked: tuple[bool, ...] = ()  # per row: verified lookup guesses; () = none did
    beyond: tuple[bool | None, ...] = ()  # per row: RowPlan.beyond; () = none known
    width: int | None = None  # slots each drafting row drafted; None: the whole block
    committed: tuple[int, ...] = ()  # tokens committed per row (after stop tokens and budgets)

    @classmethod
    def of(cls, plans: list[RowPlan], committed: list[int], width: int, draft_seconds: float, verify_seconds: float):
        return cls(
            ks=tuple(p.k for p in plans),
            accepted=tuple(p.accepted for p in plans),
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            looked=tuple(p.looked for p in plans),
            beyond=tuple(p.beyond for p in plans),
            width=width,
            committed=tuple(committed),
        )

    @property
    def rows(self) -> int:
        return len(self.ks)

    @property
    def drafted_tokens(self) -> int:
        return sum(self.ks) - len(self.ks)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def lookup_steps(self) -> int:
        return sum(self.looked)

    @property
    def lookup_accepted_tokens(self) -> int:
        return sum(a for a, lk in zip(self.accepted, self.looked) if lk)

    @property
    def tokens(self) -> int:
        return sum(self.committed)
