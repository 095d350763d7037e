"""Throughput at the user's interactivity: a server's total tokens/s at a fixed tokens/s per user, read off its measured
Pareto curve, and the inverse (the per-user speed a total throughput leaves each user).

NVIDIA states DFlash's serving results this way ("more than 15x at 500-600 tok/s/user") and tells teams to compare
the curve against their baseline at their own interactivity target; no harness reads it off for them. A curve is one
server's points (per-user tokens/s, total tokens/s), one per concurrency level of a load sweep (`loadgen.compare`).

Invariant: the readout interpolates piecewise linearly between two measured neighbours and never extrapolates; a
target outside the measured range is None ("not reached"), never a guess. Where a curve folds back (two segments span
the target), the higher reading is the curve's: a server can always be run at its better point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PER_USER, TOTAL = "tokens_per_s_per_user", "steady_tokens_per_s"  # the level summary's keys (loadgen.summary)


@dataclass(frozen=True)
class Point:
    concurrency: int
    per_user: float  # output tokens/s a user sees (the level's median request)
    total: float  # the server's output tokens/s while every client is busy


def curve(levels: Sequence[dict]) -> list[Point]:
    """A server's levels (loadgen's summaries) as points in concurrency order; a level without a steady window has no
    point."""
    points = [Point(lv["concurrency"], lv[PER_USER], lv[TOTAL]) for lv in levels if lv.get(TOTAL) and lv.get(PER_USER)]
    return sorted(points, key=lambda p: p.concurrency)


def _read(points: Sequence[Point], x: float, at: str, out: str) -> float | None:
    """`out` where the curve's `at` equals x, linearly between neighbouring levels; the highest such reading, or None."""
    found = []
    for a, b in zip(points, points[1:]):
        xa, xb = getattr(a, at), getattr(b, at)
        if min(xa, xb) <= x <= max(xa, xb):
            t = 0.0 if xa == xb else (x - xa) / (xb - xa)
            found.append(getattr(a, out) + t * (getattr(b, out) - getattr(a, out)))
    found += [getattr(p, out) for p in points if getattr(p, at) == x]  # a lone point measured exactly there
    return max(found) if found else None


def throughput_at(points: Sequence[Point], per_user: float) -> float | None:
    """Total tokens/s at `per_user` tokens/s per user; None outside the measured per-user range."""
    return _read(points, per_user, "per_user", "total")


def per_user_at(points: Sequence[Point], total: float) -> float | None:
    """Tokens/s per user at `total` tokens/s; None outside the measured throughput range."""
    return _read(points, total, "total", "per_user")


def readout(levels: dict[str, Sequence[dict]], targets: Sequence[float]) -> list[dict]:
    """Per interactivity target (tokens/s per user): each server's throughput there, and the first server's over each
    other's (None where either was not reached)."""
    curves = {name: curve(lvs) for name, lvs in levels.items()}
    names = list(curves)
    rows = []
    for target in targets:
        at = {name: throughput_at(points, target) for name, points in curves.items()}
        first = at[names[0]]
        ratios = {name: None if first is None or at[name] in (None, 0) else first / at[name] for name in names[1:]}
        rows.append({"tokens_per_s_per_user": target, "throughput": at, "ratio_to_first": ratios})
    return rows


def readout_lines(rows: list[dict], names: Sequence[str]) -> list[str]:
    """The readout as a table: one line per target, each server's tokens/s there, the first's ratio to the rest."""
    head = (
        f"{'tok/s/user':>10}  "
        + "  ".join(f"{n:>14}" for n in names)
        + "  "
        + "  ".join(f"{names[0] + '/' + n:>16}" for n in names[1:])
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = [
            f"{row['throughput'][n]:>14.1f}" if row["throughput"][n] is not None else f"{'not reached':>14}"
            for n in names
        ]
        ratios = [
            f"{row['ratio_to_first'][n]:>15.2f}x" if row["ratio_to_first"][n] is not None else f"{'-':>16}"
            for n in names[1:]
        ]
        lines.append(f"{row['tokens_per_s_per_user']:>10g}  " + "  ".join(cells) + "  " + "  ".join(ratios))
    return lines
