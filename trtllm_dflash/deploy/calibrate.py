"""`trtdflash plan --calibrate`: a TensorRT-LLM deployment's draft length by load, re-planned from what it measures
while served.

The build plans `draft_len_schedule` from a roofline of the recipe's GPU and the draft card's acceptance
(schedule.py); both are estimates. A running deployment shows, at each load of c clients, what its steps cost at the
length it drafts there, K_c (the time between streamed responses: each is one step), and its acceptance length; its
`--no-draft` twin shows what a step costs without drafting. Calibration keeps the roofline's shape in K and takes
its level from those measurements: at each measured load the roofline's verify part is scaled to the twin's step and
its drafting part to the rest of the deployment's (without a twin, one scale for both), and between loads the scales
are interpolated in log(batch) and held beyond them. Every measured step is reproduced; only the lengths not served
are modelled. The acceptance is the one measured at the lightest load that drafts (the server's acceptance length, or
on trtllm-serve the tokens per streamed chunk), spread over the positions as one conditional rate.

Invariants: the files are rewritten only with a schedule that the deployment's TensorRT-LLM release accepts
(schema.validate_llm_args), under the build's lock, model.yaml and trtllm-serve.yaml before the manifest that records
their hashes and the calibration; the servers keep the old schedule until restarted.
"""

from __future__ import annotations

import bisect
import datetime
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from trtllm_dflash.errors import DFlashError

if TYPE_CHECKING:
    from trtllm_dflash.engine.plan import DraftSchedule

SUSPECT = 4.0  # a measured step this many times the roofline's (or its inverse) is probably not this deployment's


@dataclass(frozen=True)
class Point:
    """One load as served: the length its schedule drafts there and the median time between streamed responses."""

    batch: int
    draft_len: int
    step_s: float  # the deployment's
    twin_step_s: float | None  # the --no-draft twin's
    tau: float  # the deployment's acceptance length (tokens per step)


def length_at(schedule: dict[int, int], batch: int) -> int:
    """The draft length a TensorRT-LLM schedule gives `batch` rows: that of the smallest key at or above it, none
    beyond the last key (`get_draft_len_for_batch_size`, tensorrt_llm/_torch/speculative/utils.py, main). The build
    writes both ends of every run of equal lengths, so the older reading (the largest key at or below) agrees."""
    keys = sorted(schedule)
    i = bisect.bisect_left(keys, batch)
    return schedule[keys[i]] if i < len(keys) else 0


def _interpolated(known: dict[int, float]) -> Callable[[int], float]:
    """A scale at any batch size from the measured ones: linear in log(batch) between them, held beyond them."""
    xs = sorted(known)

    def at(b: int) -> float:
        i = bisect.bisect_left(xs, b)
        if i == 0 or (i < len(xs) and xs[i] == b):
            return known[xs[i]]
        if i == len(xs):
            return known[xs[-1]]
        lo, hi = xs[i - 1], xs[i]
        w = (math.log(b) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return known[lo] * (1 - w) + known[hi] * w

    return at


def calibrated_cost(
    parts: Callable[[int, int], tuple[float, float]], points: list[Point]
) -> tuple[Callable[[int, int], float], dict[int, tuple[float, float]]]:
    """T(batch, K) through the measured points, and the (verify, drafting) scales of the roofline `parts` at each
    measured load. Where the deployment's step measured no dearer than the twin's verify of as many tokens (noise), the
    drafting part takes the verify's scale and that point is priced above its measurement (`noise_points`)."""
    verify, drafting = {}, {}
    for p in points:
        v, d = parts(p.batch, p.draft_len)
        if p.twin_step_s is None:
            verify[p.batch] = p.step_s / (v + d)
            if p.draft_len:
                drafting[p.batch] = verify[p.batch]
            continue
        verify[p.batch] = p.twin_step_s / parts(p.batch, 0)[0]
        if p.draft_len:  # a step measured no dearer than its longer verify (noise) leaves drafting at the verify scale:
            # never free, which would draft the longest length everywhere near this load
            rest = _drafting_seconds(parts, p)
            drafting[p.batch] = rest / d if rest > 0 else verify[p.batch]
    if not drafting:
        raise DFlashError("No measured load drafted, so nothing says what drafting costs; measure at 1 user.")
    sv, sd = _interpolated(verify), _interpolated(drafting)

    def cost(b: int, k: int) -> float:
        v, d = parts(b, k)
        return sv(b) * v + sd(b) * d

    return cost, {b: (sv(b), sd(b)) for b in sorted(verify)}


def _drafting_seconds(parts: Callable[[int, int], tuple[float, float]], p: Point) -> float:
    """What a drafting point's step leaves beyond the twin's step scaled to its longer verify."""
    return p.step_s - p.twin_step_s / parts(p.batch, 0)[0] * parts(p.batch, p.draft_len)[0]


def noise_points(parts: Callable[[int, int], tuple[float, float]], points: list[Point]) -> list[Point]:
    """The drafting points whose step left no time for drafting (calibrated_cost)."""
    return [p for p in points if p.draft_len and p.twin_step_s is not None and _drafting_seconds(parts, p) <= 0]


def measured_acceptance(points: list[Point], cap: int):
    """The draft's acceptance from the lightest load that drafts, one conditional rate over `cap` positions."""
    from trtllm_dflash.engine.plan import Acceptance, conditional_for_tau

    p = next((p for p in sorted(points, key=lambda p: p.batch) if p.draft_len), None)
    if p is None or p.tau < 1.0:
        raise DFlashError("No measured load drafted with an acceptance length; measure at 1 user.")
    tau = min(p.tau, p.draft_len + 1)
    rate = conditional_for_tau(tau, p.draft_len + 1)
    users = f"{p.batch} user{'s' if p.batch > 1 else ''}"
    return Acceptance((rate,) * cap, f"measured: τ {tau:.2f} at {users}, draft length {p.draft_len}")


def profile_acceptance(profile: dict, cap: int):
    """A measured speculation profile's acceptance over `cap` positions: each position the server reached, as measured;
    those past its served draft length (never reached, so never measured) at the measured positions' geometric mean,
    as measured_acceptance spreads one rate, so that re-planning may lengthen the draft."""
    from trtllm_dflash.engine.plan import Acceptance

    measured = [p for p in profile.get("conditional") or [] if p > 0][:cap]
    if not measured:
        raise DFlashError("The profile measured no accepted draft token; measure at 1 user, greedy.")
    rest = math.prod(measured) ** (1 / len(measured))
    c = profile.get("conditions") or {}
    where = f" ({c['dataset']}, {c['records']} records)" if c.get("dataset") and c.get("records") else ""
    source = f"measured per position{where}: τ {profile.get('tau', 0):.2f} at 1 user"
    return Acceptance(tuple(measured) + (rest,) * (cap - len(measured)), source)


def _points(schedule: dict[int, int], levels: dict[str, list[dict]]) -> list[Point]:
    """One Point per load the deployment was measured at (and its twin, where measured, at the same load)."""
    twin = {lv["concurrency"]: lv for lv in levels.get("twin") or []}
    out = []
    for lv in levels["deployment"]:
        c = lv["concurrency"]
        for name, measured in (("the deployment", lv), ("its twin", twin.get(c))):
            if measured is not None and (measured["errors"] or not measured["itl_p50_s"]):
                raise DFlashError(
                    f"At {c} users {name} failed requests or streamed too little to time a step "
                    f"({(measured['errors'] or ['no streamed gaps'])[0]}); nothing was rewritten."
                )
        t = twin.get(c)
        out.append(
            Point(c, length_at(schedule, c), lv["itl_p50_s"], t and t["itl_p50_s"], lv["acceptance_length_median"])
        )
    return out


def _split_yaml(path: Path) -> tuple[str, dict]:
    """A written options file's leading comment lines and its keys."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    n = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "".join(lines[:n]), yaml.safe_load("".join(lines[n:])) or {}


def _served_schedule(out: Path, recipe) -> dict[int, int]:
    """The draft_len_schedule the deployment serves (the build's plan, or a calibration's); one sentence where its
    draft lengths are not planned: no draft, or the recipe's llm_args choose them (options.planned_schedule)."""
    from trtllm_dflash.deploy.trtllm.options import planned_schedule
    from trtllm_dflash.deploy.trtllm_backend import SERVE_YAML

    spec = (_split_yaml(out / SERVE_YAML)[1].get("speculative_config")) or {}
    if planned_schedule(recipe) is None or not spec.get("draft_len_schedule"):
        raise DFlashError(
            f"{out} has no planned draft_len_schedule (no draft, or draft lengths its recipe chooses); calibration "
            "re-plans only a planned schedule."
        )
    return {int(k): int(v) for k, v in spec["draft_len_schedule"].items()}


def _recipe(manifest: dict, out: Path):
    """The deployment's recipe, rebuilt from the options the manifest recorded (what `build` planned with)."""
    from trtllm_dflash.deploy import trtllm_backend
    from trtllm_dflash.deploy.core import resolve_sources
    from trtllm_dflash.deploy.options import BuildOptions

    fields = {k: v for k, v in manifest["options"].items() if k != "output"}
    fields["opt_in"] = tuple(fields.get("opt_in") or ())
    for key, staged in (("target", "checkpoints/target"), ("draft", "checkpoints/draft")):
        recorded = fields.get(key)  # a local path on the machine that built it: on the GPU host, the staged copy
        if recorded and os.sep in recorded and not Path(recorded).expanduser().exists() and (out / staged).is_dir():
            fields[key] = str(out / staged)
    try:
        return trtllm_backend.plan_deployment(BuildOptions(output=out, **fields), lambda m: None, resolve_sources)[
            0
        ].recipe
    except (DFlashError, TypeError) as e:
        raise DFlashError(f"{out}: cannot rebuild its recipe from the options its manifest records ({e}).") from None


@dataclass(frozen=True)
class Calibration:
    points: list[Point]
    scales: dict[int, tuple[float, float]]  # measured batch -> (verify, drafting) scale of the roofline
    before: dict[int, int]
    schedule: DraftSchedule
    warnings: list[str]

    def record(self) -> dict:
        """What the manifest (and gpu-check.json) keeps of it."""
        return {
            "points": [asdict(p) for p in self.points],
            "scales": {str(b): list(s) for b, s in self.scales.items()},
            "acceptance": self.schedule.inputs[0][1],
            "cost": self.schedule.inputs[1][1],
            "schedule_before": {str(k): v for k, v in self.before.items()},
            "draft_len_schedule": {str(k): v for k, v in self.schedule.schedule().items()},
            "planned": [asdict(r) for r in self.schedule.rows],
            "warnings": self.warnings,
        }

    def table(self) -> str:
        rows = [
            "| users | draft length | step (ms) | twin step (ms) | τ | roofline scale verify / drafting |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for p in self.points:
            sv, sd = self.scales[p.batch]
            twin = f"{p.twin_step_s * 1e3:.2f}" if p.twin_step_s is not None else "-"
            rows.append(
                f"| {p.batch} | {p.draft_len} | {p.step_s * 1e3:.2f} | {twin} | {p.tau:.2f} | {sv:.2f} / {sd:.2f} |"
            )
        return "\n".join(
            ["Measured:", *rows, "", "Re-planned (draft_len_schedule):", self.schedule.table()]
            + [f"Warning: {w}" for w in self.warnings]
        )


def read_deployment(deployment: str | Path) -> tuple[Path, dict, dict[int, int], object]:
    """(folder, manifest, the draft_len_schedule it serves, its recipe) of a TensorRT-LLM deployment with a planned
    schedule; one sentence where calibration cannot re-plan it."""
    from trtllm_dflash.deploy.core import read_build

    out = Path(deployment).expanduser().resolve()
    manifest = read_build(out)
    if manifest["serve"].get("backend") != "trtllm":
        raise DFlashError(
            f"{out} is an embedded build: its engine plans its draft lengths from steps it measures at start-up; "
            "calibration re-plans a TensorRT-LLM deployment."
        )
    recipe = _recipe(manifest, out)
    return out, manifest, _served_schedule(out, recipe), recipe


def levels_for(recipe, concurrency: list[int] | None) -> list[int]:
    """The loads to measure: `concurrency`, default the batch sizes 1, 2, 4, ... up to max_batch_size."""
    from trtllm_dflash.engine.plan import batch_sizes

    levels = concurrency or batch_sizes(recipe.max_batch_size)
    if max(levels) > recipe.max_batch_size:
        raise DFlashError(
            f"--concurrency {max(levels)} exceeds the deployment's max_batch_size {recipe.max_batch_size}: such "
            "a load would queue, and its steps would not be those of its batch size."
        )
    return levels


def calibrate(
    deployment: str | Path,
    url: str,
    twin: str | None = None,
    concurrency: list[int] | None = None,
    *,
    prompts_file: str | None = None,
    max_tokens: int = 128,
    requests: int = 0,
    rounds: int = 1,
    dry_run: bool = False,
    progress=print,
) -> Calibration:
    """Load the deployment's server at `url` (and its --no-draft twin at `twin`) at every level (levels_for), measure
    its speculation profile at one user (bench.measure_profile), then `replan`."""
    from trtllm_dflash.clients.bench import measure_profile, read_prompts
    from trtllm_dflash.clients.loadgen import compare, default_prompts

    out, _, _, recipe = read_deployment(deployment)
    levels_at = levels_for(recipe, concurrency)
    prompts = read_prompts(prompts_file) if prompts_file else default_prompts()
    servers = {"deployment": url} | ({"twin": twin} if twin else {})
    progress(f"measuring {', '.join(servers)} at {levels_at} users")
    levels = compare(
        servers, prompts, levels_at, max_tokens=max_tokens, requests=requests, rounds=rounds, progress=progress
    )
    progress("measuring the draft's acceptance per position at 1 user on the built-in set")
    profile = measure_profile(url, max_tokens=max_tokens, server=f"deployment ({url})")
    return replan(out, levels, servers, dry_run=dry_run, profile=profile)


def replan(
    deployment: str | Path,
    levels: dict[str, list[dict]],
    servers: dict[str, str],
    dry_run: bool = False,
    profile: dict | None = None,
):
    """Re-plan the deployment's draft length by load from measured levels (`loadgen.compare`'s, the deployment's under
    "deployment" and its twin's, if measured, under "twin") and, where given, its measured speculation profile (the
    acceptance per position; else the lightest drafting load's τ spread over the positions), check the new options
    against its TensorRT-LLM release, and unless `dry_run` rewrite its files and manifest and keep the profile beside
    them (specbench.PROFILE: `build --acceptance-profile` takes it)."""
    from trtllm_dflash.atomic import locked
    from trtllm_dflash.deploy.schedule import CONTEXT, roofline_parts
    from trtllm_dflash.engine.plan import plan_schedule

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out, manifest, before, recipe = read_deployment(deployment)
    points = _points(before, levels)
    parts = roofline_parts(recipe, min(CONTEXT, recipe.max_seq_len))
    cost, scales = calibrated_cost(parts, points)
    if profile is not None:
        acceptance = profile_acceptance(profile, recipe.max_draft_len)
    else:
        acceptance = measured_acceptance(points, recipe.max_draft_len)
    loads = [p.batch for p in points]
    inputs = (
        ("acceptance", acceptance.source),
        ("cost", f"roofline of {recipe.num_gpus}x {recipe.gpu_spec.name} scaled to steps measured at {loads} users"),
    )
    schedule = plan_schedule(acceptance, cost, recipe.max_batch_size, recipe.max_draft_len, inputs)
    url, gpus = servers["deployment"], f"{recipe.num_gpus}x {recipe.gpu_spec.name}"
    users = lambda b: f"{b} user{'s' if b > 1 else ''}"  # noqa: E731
    warnings = [
        f"at {users(b)} the measured step is {s:.2g}x the roofline's: is {url} serving this deployment on {gpus}?"
        for b, (s, _) in scales.items()
        if not 1 / SUSPECT <= s <= SUSPECT
    ]
    warnings += [
        f"at {users(p.batch)} the deployment's step measured no dearer than its twin's verify of as many tokens "
        "(noise), so drafting there is priced at the verify's scale"
        for p in noise_points(parts, points)
    ]
    warnings += [
        f"at {users(p.batch)} τ {p.tau:.2f} exceeds draft length {p.draft_len} + 1: the server drafts more than the "
        "schedule in this folder says (restarted since the last calibration?)"
        for p in points
        if p.draft_len and p.tau > p.draft_len + 1.05
    ]
    result = Calibration(points, scales, before, schedule, warnings)
    files = _options_files(out, schedule, manifest["options"].get("trtllm_version"))  # refused here, dry run or not
    if not dry_run:
        with locked(out, "calibration"):
            _rewrite(out, files, result, servers, started)
            if profile is not None:
                from trtllm_dflash.atomic import write_json
                from trtllm_dflash.clients.specbench import PROFILE

                write_json(out / PROFILE, profile)
    return result


def _options_files(out: Path, schedule: DraftSchedule, version: str | None) -> dict[str, str]:
    """model.yaml and trtllm-serve.yaml with the new schedule, each checked against the TensorRT-LLM release."""
    from trtllm_dflash.deploy.trtllm.schema import validate_llm_args
    from trtllm_dflash.deploy.trtllm_backend import MODEL_YAML, SERVE_YAML, options_yaml

    files = {}
    for rel in (MODEL_YAML, SERVE_YAML):
        head, options = _split_yaml(out / rel)
        options["speculative_config"] |= {
            "max_draft_len": schedule.max_draft_len,
            "draft_len_schedule": schedule.schedule(),
        }
        validate_llm_args(options, rel, version)
        files[rel] = head + options_yaml(options)
    return files


def _rewrite(out: Path, files: dict[str, str], result: Calibration, servers: dict, started: str) -> None:
    """The files, then the manifest (read again under the lock: a build may have finished since) with their hashes
    and the calibration."""
    from trtllm_dflash.cpu import cpu_model
    from trtllm_dflash.deploy.core import CALIBRATED_STEP, MANIFEST, read_build
    from trtllm_dflash.resolve import sha256_file

    staged = []
    try:
        for rel, text in files.items():
            tmp = out / f"{rel}.calibrated{os.getpid()}"
            tmp.write_text(text)
            staged.append((tmp, out / rel))
        for tmp, dest in staged:
            os.replace(tmp, dest)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    manifest = read_build(out)
    for rel, meta in manifest["steps"][CALIBRATED_STEP]["outputs"].items():  # a rebuild with the same inputs keeps them
        meta |= {"size": (out / rel).stat().st_size, "sha256": sha256_file(out / rel)}
    manifest["calibration"] = {"date": started, "client": cpu_model(), "servers": servers} | result.record()
    tmp = out / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
