"""SPEED-Bench's metrics, with the definitions of NVIDIA's harness (Model-Optimizer `examples/specdec_bench` at
a2fbac7), so a user's numbers compare with NVIDIA's:

- a step is one streamed response, its acceptance length the tokens it carries (`metrics/acceptance_rate.py`
  process_step: `len(output_id_iter)`); the first response, the prefill's token, counts too;
- Request_AL: a request's tokens over its steps, all its turns pooled; Category_AL: the unweighted mean of Request_AL
  over the category's requests; Average_AL: the unweighted mean over all requests (`metrics/specbench.py`);
- the histogram of step lengths, the conditional acceptance at k, S(k)/S(k'), with S(k) the steps of length k or more
  and k' the next shorter length seen, and the joint acceptance S(k)/S(shortest) (`metrics/acceptance_rate.py`);
  k counts the bonus token, so k is draft position k - 1;
- Output TPS: every output token over the window from the first request sent to the last response; per turn, TTFT
  `t[1] - t[0]`, end to end `t[-1] - t[0]`, generation tokens/s `(tokens - 1) / (t[-1] - t[1])`, and the step times,
  every gap between responses, the first (TTFT) included (`metrics/timing.py`).

Statistics are numbers here (the harness writes them as strings) with the harness's keys.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Turn:
    """One turn as the client saw it: when it was sent, then each streamed response's arrival and token count."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # where the server reports it (OpenAI usage)
    cached_tokens: int | None = None  # of those, copied from the server's prefix cache, where it reports it

    @property
    def times(self) -> list[float]:
        return [self.sent, *self.arrivals]

    @property
    def tokens(self) -> int:
        return sum(self.chunks)


@dataclass
class Conversation:
    """One record run in one client slot: its turns in order."""

    question_id: str
    category: str
    turns: list[Turn] = field(default_factory=list)


def stats(values: Sequence[float]) -> dict:
    """The harness's summary of a list (`compute_statistics`): min, max, mean, population std, quartiles."""
    if not values:
        return {}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "quantiles": {"0.25": q[0], "0.5": q[1], "0.75": q[2]},
    }


def acceptance(conversations: Sequence[Conversation]) -> dict:
    """Request_AL, Category_AL, Average_AL, the step-length histogram and the conditional and joint acceptance."""
    request_al: dict[str, float] = {}
    per_category: dict[str, list[float]] = {}
    histogram: dict[int, int] = {}
    for conv in conversations:
        steps = [c for turn in conv.turns for c in turn.chunks]
        if not steps:
            continue
        request_al[conv.question_id] = statistics.fmean(steps)
        per_category.setdefault(conv.category, []).append(request_al[conv.question_id])
        for c in steps:
            histogram[c] = histogram.get(c, 0) + 1
    histogram = dict(sorted(histogram.items()))
    total, running, previous = sum(histogram.values()), sum(histogram.values()), 1.0
    conditional, joint, product = {}, {}, 1.0
    for k, count in histogram.items():
        share = running / total
        conditional[k] = share / previous
        product *= conditional[k]
        joint[k] = product
        previous, running = share, running - count
    return {
        "Request_AL": request_al,
        "Category_AL": {c: statistics.fmean(v) for c, v in per_category.items()},
        "Average_AL": statistics.fmean(request_al.values()) if request_al else 0.0,
        "Acceptance_Length_Histogram": histogram,
        "Conditional_Acceptance_Rate": conditional,
        "Joint_Acceptance_Rate": joint,
    }


def timing(conversations: Sequence[Conversation]) -> dict:
    """Output TPS over the whole window, and per turn TTFT, end-to-end time, generation tokens/s and step times."""
    turns = [t for conv in conversations for t in conv.turns if t.arrivals]
    if not turns:
        return {}
    window = max(t.arrivals[-1] for t in turns) - min(t.sent for t in turns)
    out_tokens = sum(t.tokens for t in turns)
    ttft = [t.arrivals[0] - t.sent for t in turns]
    e2e = [t.arrivals[-1] - t.sent for t in turns]
    gen = [(t.tokens - 1) / (t.arrivals[-1] - t.arrivals[0]) for t in turns if len(t.arrivals) > 1]
    gaps = [b - a for t in turns for a, b in zip(t.times, t.times[1:])]
    return {
        "Output TPS": out_tokens / window if window > 0 else 0.0,
        "E2E Request Time": stats(e2e),
        "TTFT Time": stats(ttft),
        "Request Generation Step Time": stats(gaps),
        "Request Generation Tokens Per Second": stats(gen),
        "Number of Output Tokens": stats([t.tokens for t in turns]),
    }


PROFILE = "speculation_profile.json"


def per_position(histogram: dict[int, int]) -> list[float]:
    """The conditional acceptance of each draft position j = 1, 2, ...: S(j + 1) / S(j), S(k) the steps that committed
    k tokens or more (the bonus token counted); a position no step reached is left out."""
    steps = {k: v for k, v in histogram.items() if k > 0}
    longest = max(steps, default=1)
    at_least = [sum(v for k, v in steps.items() if k >= n) for n in range(1, longest + 1)]
    return [b / a for a, b in zip(at_least, at_least[1:]) if a]


def profile(conversations: Sequence[Conversation], conditions: dict) -> dict:
    """A speculation profile: the conditional acceptance per draft position and τ, overall and per category, and the
    conditions they were measured under (`build --acceptance-profile` plans draft lengths from it: engine/plan.py)."""
    categories = sorted({c.category for c in conversations})
    overall = acceptance(conversations)
    by_category = {cat: acceptance([c for c in conversations if c.category == cat]) for cat in categories}
    return {
        "format": "trtllm-dflash speculation profile 1",
        "conditional": per_position(overall["Acceptance_Length_Histogram"]),
        "tau": overall["Average_AL"],
        "categories": {
            cat: {"conditional": per_position(a["Acceptance_Length_Histogram"]), "tau": a["Average_AL"]}
            for cat, a in by_category.items()
        },
        "conditions": conditions,
    }
