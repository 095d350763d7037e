"""`trtdflash build`: target + draft -> a self-contained, servable output directory.

The build is a list of named steps planned up front (so `--dry-run` can print it) and run into a
temporary sibling directory that is renamed into place at the end. Each step has a key (a hash of
its inputs, source content hashes included); a step whose key matches the previous build's manifest
and whose outputs are intact is reused instead of redone. Backends contribute their own steps: the
embedded `torch` backend stages checkpoints and fills the Triton repository; a TensorRT-LLM backend
adds conversion / quantization / tensor-parallel sharding steps in the same list.

Layout of the output (paths in the Triton configs are relative, so the directory can be moved):
    manifest.json             what was built from what (sources + hashes, options, versions, steps)
    checkpoints/target/       target HF checkpoint (weights hard-linked from the source when possible)
    checkpoints/draft/        DFlash draft (z-lab format)
    tokenizer/                tokenizer files for pre/postprocessing
    triton_repo/              preprocessing, dflash, postprocessing, ensemble
Weights are hard links when source and output share a filesystem (no extra disk, and the output
stays valid if the source cache is deleted), otherwise copies; never symlinks, which would break
when the source moves.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trtllm_dflash.atomic import locked, recover, replace_dir
from trtllm_dflash.config import ENGINE_FILE, EngineOptions, block_size_of
from trtllm_dflash.deploy.options import (
    DTYPE_BYTES,
    TORCH_MAX_BATCH,
    BuildOptions,
    Sources,
    hash_file,
    resolve_sources,
    stage,
)
from trtllm_dflash.deploy.steps import Step, stage_step, target_steps, template_step, text_step, versions
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import PRESETS, preset_for, sha256_file
from trtllm_dflash.serving.repository import RepoParams
from trtllm_dflash.untrusted import inside

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CALIBRATED_STEP = "engine_options"  # writes the files `trtdflash plan --calibrate` rewrites (calibrate.py)
RUNTIME_OVERHEAD = 600 << 20  # torch + tritonserver + 3 python backend stubs, measured RSS on CPU (rounded up)


@dataclass
class Plan:
    options: BuildOptions
    sources: Sources | None  # None: a TensorRT-LLM preset whose weights the GPU host fetches
    steps: list[Step]
    hashes: dict[str, str]  # source path -> sha256
    deployment: object | None = None  # trtllm_backend.Deployment for the TensorRT-LLM backend

    @property
    def backend(self) -> str:
        return "torch" if self.deployment is None else "trtllm"

    def memory_estimate(self) -> dict[str, int]:
        """Bytes per device: the TensorRT-LLM plan per GPU, or for the torch backend the weights in the build
        dtype + a full KV cache per concurrent request + the prefix cache's K/V + runtime."""
        if self.deployment is not None:
            m = self.deployment.memory
            return {label: b for label, b in m.rows} | {"total": m.total_bytes, "gpu_memory": m.gpu_memory_bytes}
        b = DTYPE_BYTES[self.options.dtype]
        s = self.sources
        kv = s.kv_bytes_per_token * s.max_seq_len * self.max_batch_size
        prefix = s.kv_bytes_per_token * self.options.prefix_cache_tokens
        return {
            "weights": (s.target_params + s.draft_params) * b,
            "kv_cache": kv,
            "prefix_cache": prefix,
            "runtime": RUNTIME_OVERHEAD,
            "total": (s.target_params + s.draft_params) * b + kv + prefix + RUNTIME_OVERHEAD,
        }

    @property
    def max_batch_size(self) -> int:
        return (
            self.deployment.recipe.max_batch_size
            if self.deployment
            else (self.options.max_batch_size or TORCH_MAX_BATCH)
        )


def _torch_steps(opts: BuildOptions, src: Sources, hashes: dict[str, str]) -> list[Step]:
    steps = target_steps(src, opts.quant if opts.quant not in (None, "none") else None, hashes)
    if src.draft_dir is not None:
        steps.append(
            stage_step(
                "draft_checkpoint",
                "stage the DFlash draft (z-lab format)",
                "checkpoints/draft",
                src.draft_files,
                hashes,
            )
        )
    params = RepoParams(
        max_batch_size=opts.max_batch_size or TORCH_MAX_BATCH,
        max_seq_len=src.max_seq_len,
        tokenizer_dir="../../tokenizer",
        apply_chat_template=opts.chat_template,
    )
    engine = EngineOptions(
        target_dir="../../checkpoints/target",
        draft_dir="../../checkpoints/draft" if src.draft_dir else "",
        dtype=opts.dtype,
        block_size=src.block_size,
        speculation=opts.speculation,
        lookup=opts.lookup,
        int8_draft=opts.int8_draft,
        weights=opts.weights,
        prefix_cache_tokens=opts.prefix_cache_tokens,
    )
    steps.append(template_step(params))
    steps.append(
        text_step(
            "engine_options",
            "write the engine's options",
            {f"triton_repo/{params.engine_model}/{ENGINE_FILE}": engine.to_json()},
        )
    )
    return steps


def _hash_sources(src: Sources | None, progress) -> dict[str, str]:
    hashes: dict[str, str] = {}
    if src is not None:
        progress("Hashing sources...")
        for p in src.target_files + src.draft_files:
            hashes[str(p)] = hash_file(p, hashes)
    return hashes


def make_plan(opts: BuildOptions, progress: Callable[[str], None] = print) -> Plan:
    opts.check()
    if opts.dtype == "auto":  # the build records the dtype it chose, so a build moved to another CPU keeps it
        from trtllm_dflash.cpu import resolve_dtype

        opts = replace(opts, dtype=resolve_dtype(opts.dtype))
    if opts.resolved_backend == "trtllm":
        from trtllm_dflash.deploy import trtllm_backend

        deployment, src = trtllm_backend.plan_deployment(opts, progress, resolve_sources)
        hashes = _hash_sources(src, progress)
        steps = trtllm_backend.steps(opts, deployment, src, hashes)
        return Plan(
            opts,
            src,
            steps + _draft_engine_steps(opts, src, hashes, deployment.recipe.max_batch_size, progress),
            hashes,
            deployment,
        )
    if not Path(opts.target).expanduser().is_dir() and preset_for(opts.target) is None:
        from trtllm_dflash.deploy.recipes import presets

        raise DFlashError(
            f"Unknown target {opts.target!r}: it is neither a local directory, an embedded preset ({', '.join(PRESETS)}) "
            f"nor a GPU preset ({', '.join(presets())}); models are never downloaded at build time."
        )
    src = resolve_sources(opts, progress)
    hashes = _hash_sources(src, progress)
    steps = _torch_steps(opts, src, hashes) + _draft_engine_steps(
        opts, src, hashes, opts.max_batch_size or TORCH_MAX_BATCH, progress
    )
    return Plan(opts, src, steps, hashes)


def _draft_engine_steps(
    opts: BuildOptions, src: Sources | None, hashes: dict[str, str], max_batch: int, progress
) -> list[Step]:
    if not opts.draft_engine:
        return []
    from trtllm_dflash.deploy import draft_engine

    return draft_engine.steps(opts, src, hashes, max_batch, progress)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _header(plan: Plan) -> list[str]:
    o, s = plan.options, plan.sources
    if plan.deployment is not None:
        d = plan.deployment
        r, p = d.recipe, d.recipe.parallel
        return [
            f"Build plan -> {o.output} (backend trtllm, recipe {r.id}: {r.num_gpus} x {r.gpu.upper()}, tp {p.tp}, pp {p.pp}, "
            f"ep {p.ep}, attention-dp {'on' if p.attention_dp else 'off'}, quant {r.quant}, KV cache {r.kv_cache_dtype})",
            f"  target  {r.weights if not d.local else s.target_dir}"
            + ("" if d.local else "  (fetched on the GPU host)"),
            f"  draft   {d.draft_ref or 'none (autoregressive)'}"
            + (
                f", {d.schedule.schedule() if d.schedule else r.max_draft_len} draft tokens by batch"
                if d.draft_ref
                else ""
            ),
            f"  max_batch_size {r.max_batch_size}, max_seq_len {r.max_seq_len}, max_num_tokens {r.max_num_tokens}",
        ]
    return [
        f"Build plan -> {o.output} (backend torch, dtype {o.dtype})",
        f"  target  {s.target_dir} ({s.target_params / 1e6:.1f}M params)",
        f"  draft   {s.draft_dir or 'none (autoregressive)'}"
        + (f" ({s.draft_params / 1e6:.1f}M params)" if s.draft_dir else ""),
        f"  block size {s.block_size}, max_seq_len {s.max_seq_len}, max_batch_size {plan.max_batch_size}",
    ]


def describe(plan: Plan) -> str:
    """Human-readable plan for --dry-run."""
    s = plan.sources
    what = (
        "target, draft and tokenizer fit together"
        if plan.deployment is None
        else "recipe, parallel layout, draft vs target, memory plan and every LLM-API option"
    )
    lines = _header(plan) + ["Steps:", f"  1. resolve_and_validate: {what} (done)"]
    for i, step in enumerate(plan.steps, 2):
        lines.append(f"  {i}. {step.name}: {step.description} [{_fmt(sum(f.size for f in step.files))}]")
        for f in step.files:
            lines.append(f"       {f.rel}  {_fmt(f.size)}" + ("  (link or copy)" if f.source else ""))
    lines.append(f"  {len(plan.steps) + 2}. manifest: write {MANIFEST}")
    if plan.deployment is not None:
        lines.append(plan.deployment.memory.describe())
        if (schedule := plan.deployment.schedule) is not None:
            lines += ["Draft length by load (draft_len_schedule, planned):", schedule.table()]
        return "\n".join(lines)
    mem = plan.memory_estimate()
    lines.append(
        f"Estimated memory per device (cpu, 1 device): {_fmt(mem['total'])} = weights {_fmt(mem['weights'])} + "
        f"KV cache {_fmt(mem['kv_cache'])} ({plan.max_batch_size} x {s.max_seq_len} tokens) + prefix cache "
        f"{_fmt(mem['prefix_cache'])} ({plan.options.prefix_cache_tokens} tokens) + runtime {_fmt(mem['runtime'])}"
    )
    return "\n".join(lines)


def _sources_manifest(plan: Plan) -> dict:
    s, d = plan.sources, plan.deployment
    if s is None:  # a preset the GPU host fetches
        return {"target": {"hf_id": d.target_ref}, "draft": None if d.draft_ref is None else {"hf_id": d.draft_ref}}
    return {
        "target": {"path": str(s.target_dir), "files": {p.name: plan.hashes[str(p)] for p in s.target_files}},
        "draft": None
        if s.draft_dir is None
        else {"path": str(s.draft_dir), "files": {p.name: plan.hashes[str(p)] for p in s.draft_files}},
    }


def _resolved(plan: Plan) -> dict:
    if plan.deployment is None:
        s = plan.sources
        return {
            "block_size": s.block_size,
            "max_seq_len": s.max_seq_len,
            "max_batch_size": plan.max_batch_size,
            "memory_estimate_bytes": plan.memory_estimate(),
        }
    r, m = plan.deployment.recipe, plan.deployment.memory
    return {
        "recipe": r.id,
        "gpu": r.gpu,
        "num_gpus": r.num_gpus,
        "block_size": block_size_of(r.max_draft_len),
        "max_seq_len": r.max_seq_len,
        "max_batch_size": r.max_batch_size,
        "memory_plan_bytes_per_gpu": plan.memory_estimate(),
        "fits": m.fits,
        "max_batch_size_that_fits": m.max_batch_size_that_fits,
    }


def _read_manifest(out: Path) -> dict | None:
    """The manifest, checked (None if there is none or it is not JSON): it is read back from disk, so it is input like
    any other, and every path in it must stay inside the build."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None

    def damaged(why: str):
        raise DFlashError(f"{out / MANIFEST} is damaged or was edited ({why}); delete {out} and build it again.")

    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        damaged(
            f"format {manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {MANIFEST_FORMAT}"
        )
    serve, steps = manifest.get("serve"), manifest.get("steps")
    resolved, options = manifest.get("resolved"), manifest.get("options")
    if not isinstance(serve, dict) or not isinstance(serve.get("model"), str):
        damaged("serve.model is missing")
    if not (
        isinstance(resolved, dict)
        and isinstance(resolved.get("max_seq_len"), int)
        and isinstance(options, dict)
        and isinstance(options.get("target"), str)
    ):
        damaged("resolved.max_seq_len or options.target is missing")
    inside(serve.get("model_repository"), out)
    if not isinstance(steps, dict) or not all(
        isinstance(s, dict) and isinstance(s.get("outputs"), dict) for s in steps.values()
    ):
        damaged("steps are malformed")
    for step in steps.values():
        for rel, meta in step["outputs"].items():
            inside(rel, out)
            if not isinstance(meta, dict) or not isinstance(meta.get("size"), int):
                damaged(f"{rel} has no size")
    return manifest


def _reusable(step: Step, old: dict | None, out: Path) -> bool:
    """The previous build ran this step with the same inputs and its outputs are still there, same sizes."""
    prev = (old or {}).get("steps", {}).get(step.name)
    if not prev or prev.get("key") != step.key:
        return False
    return all(
        (out / rel).is_file() and (out / rel).stat().st_size == meta["size"] for rel, meta in prev["outputs"].items()
    ) and all((out / rel).is_dir() for rel in step.dirs)


Verify = Callable[[Path], tuple[str, dict]]  # a finished build's folder -> (manifest key, record), or DFlashError


def run_build(
    opts: BuildOptions, progress: Callable[[str], None] = print, dry_run: bool = False, verify: Verify | None = None
) -> Path:
    """Plan, then build atomically under an exclusive lock on the output; returns the output directory.

    Killed at any point (SIGINT, SIGKILL), the output is the previous complete build or absent; the next run
    removes what the killed one left beside it. A second build of the same output at once is refused. `verify` runs
    on the finished build in its temporary folder before it replaces the output (clients/bench.py's build-time
    acceptance gate): its record joins the manifest, and where it raises, the output stays as it was."""
    out = Path(opts.output).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--output {out} is a file; pass a directory path.")
    if dry_run:
        return _build(opts, out, progress, dry_run=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out):
        if leftovers := recover(out):
            progress(f"Cleaned up after an interrupted build of {out}: {', '.join(leftovers)}.")
        return _build(opts, out, progress, dry_run=False, verify=verify)


def _build(
    opts: BuildOptions, out: Path, progress: Callable[[str], None], dry_run: bool, verify: Verify | None = None
) -> Path:
    old = _read_manifest(out) if out.is_dir() else None
    if out.is_dir() and old is None and any(out.iterdir()):
        raise DFlashError(
            f"--output {out} exists and is not a trtdflash build (no {MANIFEST}); pick a new directory or remove it."
        )
    plan = make_plan(opts, progress)
    if dry_run:
        progress(describe(plan))
        return out
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(plan.options).items()} | {
        "output": str(out),
        "backend": plan.backend,
    }
    options = json.loads(json.dumps(options))  # as the manifest holds them (tuples become lists), so they compare
    reuse = {step.name: _reusable(step, old, out) for step in plan.steps}
    if (
        old
        and verify is None
        and all(reuse.values())
        and {s.name for s in plan.steps} == set(old.get("steps", {}))
        and old.get("options") == options
    ):
        progress(f"{out} is up to date (same inputs, outputs intact); nothing to do.")
        return out

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        steps_meta = {}
        for i, step in enumerate(plan.steps, 1):
            t0 = time.perf_counter()
            if reuse[step.name]:
                progress(f"[{i}/{len(plan.steps)}] {step.name}: unchanged, reusing the previous output")
                for rel in old["steps"][step.name]["outputs"]:
                    stage(out / rel, tmp / rel)
                for rel in step.dirs:
                    (tmp / rel).mkdir(parents=True, exist_ok=True)
            else:
                progress(f"[{i}/{len(plan.steps)}] {step.name}: {step.description}...")
                step.run(tmp, progress)
            outputs = {}
            for f in step.outputs(tmp):
                p = tmp / f.rel
                sha = plan.hashes[str(f.source)] if f.source else sha256_file(p)
                outputs[f.rel] = {"size": p.stat().st_size, "sha256": sha}
            steps_meta[step.name] = {"key": step.key, "outputs": outputs, "seconds": round(time.perf_counter() - t0, 3)}
        manifest = {
            "format": MANIFEST_FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": versions(),
            "options": options,
            "sources": _sources_manifest(plan),
            "resolved": _resolved(plan),
            "serve": {"model_repository": "triton_repo", "model": "ensemble", "backend": plan.backend},
            "steps": steps_meta,
        }
        if old and "calibration" in old and reuse.get(CALIBRATED_STEP):  # the files it rewrote were kept
            manifest["calibration"] = old["calibration"]
        if verify is not None:
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # what a server reads of the build
            key, record = verify(tmp)
            manifest[key] = record
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(
        f"Built {out} ({len(plan.steps)} steps, {sum(not r for r in reuse.values())} run, {sum(reuse.values())} reused)."
    )
    return out


def record_in_manifest(out: Path, key: str, value: dict) -> None:
    """Add `key` to a finished build's manifest (an acceptance gate's verdict), whole or not at all; a later build
    writes a new manifest, so a verdict never outlives the build it judged."""
    out = Path(out).expanduser()
    manifest = read_build(out) | {key: value}
    tmp = out / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)


def read_build(out: Path) -> dict:
    """The manifest of a finished build; what `serve` checks before starting Triton."""
    out = Path(out).expanduser()
    manifest = _read_manifest(out)
    if manifest is None:
        raise DFlashError(
            f"{out} is not a trtdflash build output (no readable {MANIFEST}); run `trtdflash build --output {out}` first."
        )
    return manifest
