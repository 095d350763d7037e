"""Refuse, before anything is written, every LLM-API option file that TensorRT-LLM would refuse at `LLM()`.

Two checks, both per TensorRT-LLM release (`--trtllm-version`):
  * field lists (releases/<release>.json): every key, type and enum of TorchLlmArgs and the sections we write
    (kv_cache_config, cuda_graph_config, moe_config, attention_dp_config, speculative_config = DFlashDecodingConfig
    with DecodingBaseConfig's fields). Upstream's models are strict: an unknown key is an error there too.
  * upstream's validators that touch a field we write, reproduced with upstream's own message, from
    NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py at main@0004396720054fd8e205cbf616f21f0b57c6b412:
    DecodingBaseConfig.validate_draft_len_schedule_and_sort, ...validate_max_concurrency_and_draft_len_schedule_
    mutually_exclusive, BaseCudaGraphConfig.validate_base_cuda_graph_config, KvCacheConfig.validate_dtype and
    validate_free_gpu_memory_fraction, TorchLlmArgs.validate_speculative_config (DFlash max_draft_len), and the
    pydantic bounds (stream_interval PositiveInt, max_concurrency PositiveInt, acceptance_rate_threshold [0, 1]).
    The two releases' validator sources could not be read (their docs give the signatures only); the validators
    above predate both releases, so they are applied to every release.

Each release file says in its `source` which sections were verified against what; DEPLOY.md and the README
name the release a deployment was validated against.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from trtllm_dflash.errors import DFlashError

# The release a deployment targets unless --trtllm-version says otherwise, and the container that carries it.
DEFAULT_RELEASE = "1.4.0rc1"
CONTAINER = "nvcr.io/nvidia/tensorrt-llm/release:{release}"
# The first release with DFlash in the one-model path (PR #12794): its release notes list
# it in v1.3.0rc14 and the full rc13 changelog does not (no tag was read: the repository's history was out of reach,
# so this rests on the release notes). launch.sh refuses an older TensorRT-LLM in one sentence.
FIRST_DFLASH_RELEASE = "1.3.0rc14"
# Later fixes a DFlash deployment relies on: (the first release certain to carry it, PR, what is wrong without it).
# launch.sh names each one the running release lacks. From the PRs' merges into main and the releases' cut dates (a
# release is cut from main between its own version bump and the next); where the cut falls close to the merge, the
# later release is named: #16548 may already be in rc22, #17082 in rc24.
DFLASH_FIXES = (
    ("1.3.0rc22", "#15775", "sampling (temperature > 0) is not verified by rejection sampling, so it is not exact"),
    ("1.3.0rc23", "#16548", "CUDA-graph padding requests can write into a live request's draft context slot"),
    ("1.3.0rc25", "#17082", "the PyTorch flow reports zero draft and accepted tokens in its request perf metrics"),
)
_FILES = {
    "1.4.0rc4": "1.4.0rc4.json",
    "1.4.0rc1": "1.4.0rc1.json",
    "1.3.0rc29": "1.3.0rc29.json",
    "main@0004396": "main-0004396.json",
}
RELEASES = tuple(_FILES)

_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list": (list, tuple), "dict": (dict,)}


@dataclass(frozen=True)
class Release:
    name: str
    commit: str | None
    source: str
    sections: dict[str, Any]

    @property
    def label(self) -> str:
        return f"TensorRT-LLM {self.name}"

    @property
    def container(self) -> str:
        return CONTAINER.format(release=self.name) if "@" not in self.name else "a container built from that commit"


@cache
def release(name: str | None = None) -> Release:
    name = name or DEFAULT_RELEASE
    if name not in _FILES:
        raise DFlashError(f"--trtllm-version must be one of {', '.join(RELEASES)}, got {name!r}.")
    raw = json.loads((resources.files(__package__) / "releases" / _FILES[name]).read_text())
    return Release(name, raw["commit"], raw["source"], raw["sections"])


def _check_value(value: Any, spec: Any, path: str, cls: str, where: str) -> None:
    spec = {"type": spec} if isinstance(spec, str) else spec
    kind = spec["type"].rstrip("?")
    if kind in ("any", "section"):
        return
    if value is None:
        if spec["type"].endswith("?"):
            return
        raise DFlashError(f"{where}: {path} may not be null in TensorRT-LLM's {cls}.")
    if not isinstance(value, _TYPES[kind]) or (kind in ("int", "float") and isinstance(value, bool)):
        raise DFlashError(f"{where}: {path} must be {kind} for TensorRT-LLM's {cls}, got {value!r}.")
    if "enum" in spec:
        allowed = spec["enum"]
        ok = (str(value).upper() in [a.upper() for a in allowed]) if spec.get("case_insensitive") else value in allowed
        if not ok:
            raise DFlashError(f"{where}: {path} is {value!r}; TensorRT-LLM's {cls} accepts {', '.join(allowed)}.")
    for bound, broken, words in (
        ("gt", lambda b: value <= b, "greater than"),
        ("min", lambda b: value < b, "greater than or equal to"),
        ("max", lambda b: value > b, "less than or equal to"),
    ):
        if bound in spec and broken(spec[bound]):  # pydantic's own words for gt / ge / le
            raise DFlashError(
                f"{where}: {path} is {value!r}; TensorRT-LLM's {cls} says: Input should be {words} {spec[bound]}."
            )


def _check_section(rel: Release, options: Mapping[str, Any], section: str, where: str) -> None:
    entry = rel.sections[section]
    fields, cls = entry["fields"], entry["class"]
    prefix = f"{section}." if section else ""
    for key, value in options.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise DFlashError(f"{where}: {prefix}{key} is not a {rel.label} {cls} field{hint}.")
        _check_value(value, fields[key], prefix + key, cls, where)
        if fields[key] == "section" and value is not None:  # null is TensorRT-LLM's "off" (e.g. no CUDA graphs)
            if not isinstance(value, Mapping):
                raise DFlashError(
                    f"{where}: {key} must be a mapping of {rel.sections[key]['class']} fields, got {value!r}."
                )
            _check_section(rel, value, key, where)


def upstream_errors(options: Mapping[str, Any]) -> list[str]:
    """The messages TensorRT-LLM's validators raise for `options` (field lists already checked), in upstream's words."""
    errors = []
    spec = options.get("speculative_config") or {}
    max_draft_len = spec.get("max_draft_len")
    schedule = spec.get("draft_len_schedule")
    if schedule:
        keys = {int(k): v for k, v in schedule.items()}  # YAML keys may arrive as strings through JSON
        for batch_size, draft_len in keys.items():
            if batch_size < 1:
                errors.append(f"draft_len_schedule: batch size threshold must be >= 1, got {batch_size}")
            if draft_len < 0:
                errors.append(f"draft_len_schedule: draft length must be >= 0, got {draft_len}")
        if max_draft_len is not None and not errors:
            smallest = min(keys)
            if keys[smallest] != max_draft_len:
                errors.append(
                    f"draft_len_schedule[{smallest}] must equal max_draft_len because it is the smallest "
                    f"batch-size key. Got schedule[{smallest}]={keys[smallest]}, but max_draft_len={max_draft_len}."
                )
            for batch_size, draft_len in sorted(keys.items()):
                if draft_len > max_draft_len:
                    errors.append(
                        f"draft_len_schedule: all draft lengths must be <= max_draft_len. Got draft_len="
                        f"{draft_len} for batch_size={batch_size}, but max_draft_len={max_draft_len}."
                    )
    if spec.get("max_concurrency") is not None and schedule:
        errors.append(
            "max_concurrency and draft_len_schedule are mutually exclusive. Use max_concurrency for a simple "
            "speculation cutoff, or draft_len_schedule for dynamic draft-length control."
        )
    if spec.get("decoding_type") == "DFlash" and (max_draft_len is None or max_draft_len <= 0):
        errors.append("DFlash max_draft_len must be > 0")
    graphs = options.get("cuda_graph_config") or {}
    sizes, graph_max = graphs.get("batch_sizes"), graphs.get("max_batch_size") or 0
    if sizes and graph_max and graph_max != max(sizes):
        errors.append(
            "CudaGraphConfig.max_batch_size is incompatible with CudaGraphConfig.batch_sizes. When both are "
            f"provided, max_batch_size must equal max(batch_sizes).\nCudaGraphConfig.batch_sizes: "
            f"{sorted(sizes)}, max(batch_sizes): {max(sizes)}, CudaGraphConfig.max_batch_size: {graph_max}"
        )
    kv = options.get("kv_cache_config") or {}
    if "free_gpu_memory_fraction" in kv and kv["free_gpu_memory_fraction"] is None:
        errors.append("kv_cache_config.free_gpu_memory_fraction must be a float between 0 and 1")
    return errors


def validate_llm_args(options: Mapping[str, Any], where: str, trtllm_version: str | None = None) -> None:
    """Raise DFlashError naming the first unknown, mistyped or refused key of LLM-API `options` for the release."""
    rel = release(trtllm_version)
    spec = options.get("speculative_config")
    if isinstance(spec, Mapping) and spec.get("decoding_type") != "DFlash":
        raise DFlashError(
            f"{where}: speculative_config.decoding_type must be DFlash, got {spec.get('decoding_type')!r}."
        )
    _check_section(rel, options, "", where)
    if errors := upstream_errors(options):
        raise DFlashError(f"{where}: {rel.label} refuses this at LLM(): {errors[0]}")
