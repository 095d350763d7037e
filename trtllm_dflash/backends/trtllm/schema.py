"""Catch a misspelt or mistyped LLM-API key before TensorRT-LLM's strict pydantic models reject it on a GPU host.

The field lists (llm_args_schema.json) are those of one TensorRT-LLM source revision, named in RELEASE; they
cover the top-level TorchLlmArgs keys and the sections we write: kv_cache_config, cuda_graph_config,
moe_config, attention_dp_config and speculative_config (DFlashDecodingConfig with DecodingBaseConfig's fields).
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from ...errors import DFlashError

_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list": (list, tuple),
          "dict": (dict,)}


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return json.loads((resources.files(__package__) / "llm_args_schema.json").read_text())


RELEASE: str = _schema()["release"]


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
    if "min" in spec and value < spec["min"] or "max" in spec and value > spec["max"]:
        raise DFlashError(f"{where}: {path} is {value!r}; it must lie in "
                          f"[{spec.get('min', '-inf')}, {spec.get('max', 'inf')}].")


def _check_section(options: Mapping[str, Any], section: str, where: str) -> None:
    entry = _schema()["sections"][section]
    fields, cls = entry["fields"], entry["class"]
    prefix = f"{section}." if section else ""
    for key, value in options.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise DFlashError(f"{where}: {prefix}{key} is not a {RELEASE} {cls} field{hint}.")
        _check_value(value, fields[key], prefix + key, cls, where)
        if fields[key] == "section" and value is not None:  # null is TensorRT-LLM's "off" (e.g. no CUDA graphs)
            if not isinstance(value, Mapping):
                raise DFlashError(f"{where}: {key} must be a mapping of {_schema()['sections'][key]['class']} "
                                  f"fields, got {value!r}.")
            _check_section(value, key, where)


def validate_llm_args(options: Mapping[str, Any], where: str) -> None:
    """Raise DFlashError naming the first unknown or mistyped key (and its section) in LLM-API `options`."""
    spec = options.get("speculative_config")
    if isinstance(spec, Mapping) and spec.get("decoding_type") != "DFlash":
        raise DFlashError(f"{where}: speculative_config.decoding_type must be DFlash, got "
                          f"{spec.get('decoding_type')!r}.")
    _check_section(options, "", where)
