"""The wire contract of the engine step: every tensor name, type and meaning, defined once.

Clients talk to the `ensemble` with the inputs and outputs of Triton's TensorRT-LLM ensemble
(triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt). Preprocessing turns
text_input into input_ids; every other input goes straight to the engine model (`dflash`, or a
`tensorrt_llm` model with the same I/O), which parses it with `parse_request` and answers with
`response_arrays`. The config.pbtxt input/output lists and the ensemble's engine and postprocessing
maps are rendered from the tables here (`pbtxt_values`), so adding a tensor is one line.

Sampling follows TensorRT-LLM's meaning of the inputs, so its clients get what they expect: top_k 0
and top_p 0 disable those filters, and with both disabled (their default) decoding is greedy whatever
the temperature. Inputs that would need a feature speculative decoding here lacks (beams, several
sequences, penalties, logits, LoRA, prompt tables, guided decoding) are accepted at their neutral
value and rejected with one sentence otherwise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.errors import DFlashError

if TYPE_CHECKING:  # a type only: Triton's postprocessing stub imports this module, and the engine imports torch
    from trtllm_dflash.engine.request import GenerationStats

Getter = Callable[[str], "np.ndarray | None"]  # input name -> its array (batch dim first), None if absent


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton config type
    dims: str = "1"
    engine: str | None = None  # engine-model input name; None: preprocessing consumes it
    ragged: bool = False

    @property
    def datatype(self) -> str:
        """The datatype a client puts on the wire (KServe names; TYPE_STRING travels as BYTES)."""
        return "BYTES" if self.dtype == "TYPE_STRING" else self.dtype.removeprefix("TYPE_")

    def pbtxt(self, name: str | None = None, optional: bool = False) -> str:
        extra = (" optional: true" if optional else "") + (" allow_ragged_batch: true" if self.ragged else "")
        return f'{{ name: "{name or self.name}" data_type: {self.dtype} dims: [ {self.dims} ]{extra} }}'


# The ensemble's inputs: TensorRT-LLM's ensemble, in its order, then ours (apply_chat_template).
ENSEMBLE_INPUTS = (
    Tensor("text_input", "TYPE_STRING"),
    Tensor("decoder_text_input", "TYPE_STRING", engine="decoder_text_input"),
    Tensor("max_tokens", "TYPE_INT32"),
    Tensor("num_return_sequences", "TYPE_INT32", engine="num_return_sequences"),
    Tensor("bad_words", "TYPE_STRING", "-1", engine="bad_words"),
    Tensor("stop_words", "TYPE_STRING", "-1", engine="stop_words"),
    Tensor("exclude_input_in_output", "TYPE_BOOL", engine="exclude_input_in_output"),
    Tensor("end_id", "TYPE_INT32", engine="end_id"),
    Tensor("pad_id", "TYPE_INT32", engine="pad_id"),
    Tensor("top_k", "TYPE_INT32", engine="runtime_top_k"),
    Tensor("top_p", "TYPE_FP32", engine="runtime_top_p"),
    Tensor("temperature", "TYPE_FP32", engine="temperature"),
    Tensor("length_penalty", "TYPE_FP32", engine="len_penalty"),
    Tensor("repetition_penalty", "TYPE_FP32", engine="repetition_penalty"),
    Tensor("min_tokens", "TYPE_INT32", engine="min_tokens"),
    Tensor("presence_penalty", "TYPE_FP32", engine="presence_penalty"),
    Tensor("frequency_penalty", "TYPE_FP32", engine="frequency_penalty"),
    Tensor("seed", "TYPE_UINT64", engine="seed"),
    Tensor("return_log_probs", "TYPE_BOOL", engine="return_log_probs"),
    Tensor("return_context_logits", "TYPE_BOOL", engine="return_context_logits"),
    Tensor("return_generation_logits", "TYPE_BOOL", engine="return_generation_logits"),
    Tensor("return_perf_metrics", "TYPE_BOOL", engine="return_perf_metrics"),
    Tensor("return_num_input_tokens", "TYPE_BOOL", engine="return_num_input_tokens"),
    Tensor("return_num_output_tokens", "TYPE_BOOL", engine="return_num_output_tokens"),
    Tensor("beam_width", "TYPE_INT32", engine="beam_width"),
    Tensor("stream", "TYPE_BOOL", engine="streaming"),
    Tensor("prompt_embedding_table", "TYPE_FP16", "-1, -1", engine="prompt_embedding_table"),
    Tensor("prompt_table_extra_id", "TYPE_UINT64", engine="prompt_table_extra_id"),
    Tensor("prompt_vocab_size", "TYPE_INT32", engine="prompt_vocab_size"),
    Tensor("embedding_bias_words", "TYPE_STRING", "-1", engine="embedding_bias_words"),
    Tensor("embedding_bias_weights", "TYPE_FP32", "-1", engine="embedding_bias_weights"),
    Tensor("lora_task_id", "TYPE_UINT64", engine="lora_task_id"),
    Tensor("lora_weights", "TYPE_FP16", "-1, -1", engine="lora_weights", ragged=True),
    Tensor("lora_config", "TYPE_INT32", "-1, 3", engine="lora_config", ragged=True),
    Tensor("guided_decoding_guide_type", "TYPE_STRING", engine="guided_decoding_guide_type", ragged=True),
    Tensor("guided_decoding_guide", "TYPE_STRING", engine="guided_decoding_guide", ragged=True),
    Tensor("apply_chat_template", "TYPE_BOOL"),
)
REQUIRED = ("text_input", "max_tokens")
BY_NAME = {t.name: t for t in ENSEMBLE_INPUTS}

# Engine inputs preprocessing produces (required), then the client's inputs passed straight through.
INPUT_IDS, OUTPUT_LEN = "input_ids", "request_output_len"
ENGINE_INPUTS = (Tensor(INPUT_IDS, "TYPE_INT32", "-1"), Tensor(OUTPUT_LEN, "TYPE_INT32"))
PASSED = tuple(t for t in ENSEMBLE_INPUTS if t.engine)
ENGINE = {t.name: t.engine for t in PASSED}  # ensemble name -> engine name


@dataclass(frozen=True)
class Stat:
    """One per-response statistic: engine output = ensemble output name, read from stats and times."""

    name: str
    dtype: str
    value: Callable[[GenerationStats, RequestTimes], object]


NUMPY = {
    "TYPE_BOOL": np.bool_,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP32": np.float32,
    "TYPE_STRING": np.object_,
}

STATS = (
    Stat("num_input_tokens", "TYPE_INT32", lambda s, t: s.prompt_tokens),
    Stat("num_output_tokens", "TYPE_INT32", lambda s, t: s.num_tokens),
    Stat("total_draft_tokens", "TYPE_INT32", lambda s, t: s.drafted_tokens),
    Stat("total_accepted_draft_tokens", "TYPE_INT32", lambda s, t: s.accepted_tokens),
    Stat(
        "acceptance_rate", "TYPE_FP32", lambda s, t: s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else 0.0
    ),
    Stat("acceptance_length", "TYPE_FP32", lambda s, t: s.acceptance_length),
    # true where the engine gave no draft counts (TensorRT-LLM before PR #17082) and the three above are inferred
    Stat("draft_counts_estimated", "TYPE_BOOL", lambda s, t: s.draft_counts_estimated),
    Stat("finish_reason", "TYPE_STRING", lambda s, t: s.finish_reason.encode()),
    Stat("num_cached_input_tokens", "TYPE_INT32", lambda s, t: s.cached_tokens),  # copied from the prefix cache
    Stat("batch_index", "TYPE_INT32", lambda s, t: 0),  # one prompt per request
    Stat("sequence_index", "TYPE_INT32", lambda s, t: 0),  # one sequence per prompt
    Stat("arrival_time_ns", "TYPE_INT64", lambda s, t: t.arrival),
    Stat("first_scheduled_time_ns", "TYPE_INT64", lambda s, t: t.scheduled),
    Stat("first_token_time_ns", "TYPE_INT64", lambda s, t: t.first_token),
    Stat("last_token_time_ns", "TYPE_INT64", lambda s, t: t.last_token),
)
TEXT, CANCEL_KEY = "output_text", "cancel_key"  # engine outputs besides the statistics
TEXT_OUTPUT = "text_output"  # the ensemble's text output (from postprocessing)
ENGINE_OUTPUTS = (Tensor(TEXT, "TYPE_STRING"), Tensor(CANCEL_KEY, "TYPE_STRING")) + tuple(
    Tensor(s.name, s.dtype) for s in STATS
)


def _now() -> int:
    return time.monotonic_ns()


@dataclass
class RequestTimes:
    """TensorRT-LLM's per-request timing points: CLOCK_MONOTONIC nanoseconds (its steady_clock), 0 = not yet."""

    arrival: int = field(default_factory=_now)
    scheduled: int = 0
    first_token: int = 0
    last_token: int = 0

    def schedule(self) -> None:
        self.scheduled = _now()

    def token(self) -> None:
        self.last_token = _now()
        self.first_token = self.first_token or self.last_token


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0  # stop tokens are suppressed until this many tokens are generated
    streaming: bool = False
    exclude_input: bool = True  # our default; TensorRT-LLM's is false


MAX_STRINGS = 64  # stop_words, bad_words, ... per request: each is matched at every step
MAX_STRING_CHARS = (
    1024  # per string: a stop word is held back while it may still match, so it bounds the streaming delay
)
KINDS = {int: "iub", float: "iuf", bool: "biu"}  # numpy dtype kinds a scalar of each type may arrive as
CLIENT_NAME = {engine: name for name, engine in ENGINE.items()} | {
    OUTPUT_LEN: "max_tokens"
}  # errors name what the client sent


def _scalar(get: Getter, name: str, default, kind: type | None = None):
    """One value per request (batch dim first); with `kind`, of a numeric type that means it (no strings, no floats as ints)."""
    a = get(name)
    if a is None or a.size == 0:
        return default
    label = CLIENT_NAME.get(name, name)
    if a.size != 1:
        raise DFlashError(f"{label} must hold one value per request, got shape {list(a.shape)}.")
    if kind is not None and a.dtype.kind not in KINDS[kind]:
        raise DFlashError(
            f"{label} must be {'an integer' if kind is int else 'a number' if kind is float else 'a boolean'}, got {a.dtype} data."
        )
    value = a.reshape(-1)[0].item()
    return kind(value) if kind is not None else value


def _strings(get: Getter, name: str) -> list[str]:
    a = get(name)
    if a is None:
        return []
    name = CLIENT_NAME.get(name, name)
    if a.size > MAX_STRINGS:
        raise DFlashError(f"{name} holds {a.size} strings; send at most {MAX_STRINGS}.")
    try:
        strings = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in a.reshape(-1)]
    except UnicodeDecodeError:
        raise DFlashError(f"{name} is not valid UTF-8.") from None
    if any(len(x) > MAX_STRING_CHARS for x in strings):
        raise DFlashError(
            f"{name} holds a string of {max(map(len, strings))} characters; send at most {MAX_STRING_CHARS} per string."
        )
    return strings


def _unsupported(subject: str, why: str, fix: str):
    raise DFlashError(f"{subject} is not supported: {why}; {fix}.")


# Inputs honoured only at their neutral value: (ensemble name, neutral value, why not, what to send).
SCALAR_LIMITS = (
    ("beam_width", 1, "DFlash speculative decoding runs one beam", "send beam_width 1"),
    ("num_return_sequences", 1, "one request returns one sequence", "send 1 and repeat the request for more"),
    ("repetition_penalty", 1.0, "penalties are not implemented by this server", "send 1.0"),
    ("presence_penalty", 0.0, "penalties are not implemented by this server", "send 0.0"),
    ("frequency_penalty", 0.0, "penalties are not implemented by this server", "send 0.0"),
    ("return_log_probs", False, "this server does not compute log probabilities", "send false"),
    ("return_context_logits", False, "this server does not return logits", "send false"),
    ("return_generation_logits", False, "this server does not return logits", "send false"),
    ("prompt_table_extra_id", 0, "prompt tables (p-tuning) are not supported", "leave it out"),
    ("prompt_vocab_size", 0, "prompt tables (p-tuning) are not supported", "leave it out"),
)
# Inputs honoured only when absent, empty, empty strings or (weights) zeros.
EMPTY_LIMITS = (
    (
        "decoder_text_input",
        "it is for encoder-decoder models and DFlash serves a decoder-only target",
        "leave it empty",
    ),
    ("bad_words", "the dflash model does not ban words yet", "leave it empty"),
    ("embedding_bias_words", "embedding bias is not implemented by this server", "leave it empty"),
    ("embedding_bias_weights", "embedding bias is not implemented by this server", "leave it empty"),
    ("prompt_embedding_table", "prompt tables (p-tuning) are not supported", "leave it out"),
    ("lora_task_id", "LoRA adapters are not supported", "leave it out"),
    ("lora_weights", "LoRA adapters are not supported", "leave it out"),
    ("lora_config", "LoRA adapters are not supported", "leave it out"),
    ("guided_decoding_guide_type", "guided decoding is not supported", "leave it empty"),
    ("guided_decoding_guide", "guided decoding is not supported", "leave it empty"),
)


def _check_limits(get: Getter) -> None:
    for name, neutral, why, fix in SCALAR_LIMITS:
        value = _scalar(get, ENGINE[name], neutral, type(neutral))
        if value != neutral:
            _unsupported(f"{name} {str(value).lower() if isinstance(value, bool) else f'{value:g}'}", why, fix)
    for name, why, fix in EMPTY_LIMITS:
        a = get(ENGINE[name])
        if a is None:
            continue
        strings = [s for s in _strings(get, ENGINE[name]) if s] if a.dtype == np.object_ else []
        if strings:
            _unsupported(f"{name} {strings[0][:40]!r}", why, fix)
        if (a.dtype != np.object_ and np.any(a != 0)) or (name == "lora_task_id" and a.size):
            one = a.size == 1 and a.dtype != np.object_
            _unsupported(f"{name} {a.reshape(-1)[0].item():g}" if one else f"A non-empty {name}", why, fix)


def _sampling(get: Getter) -> SamplingParams:
    """TensorRT-LLM's meaning: top_k 0 / top_p 0 disable the filters; both disabled (or top_k 1) is greedy."""
    temperature = _scalar(get, ENGINE["temperature"], 1.0, float)
    top_p = _scalar(get, ENGINE["top_p"], 0.0, float)
    top_k = _scalar(get, ENGINE["top_k"], 0, int)
    seed = _scalar(get, ENGINE["seed"], None, int)
    if not math.isfinite(temperature) or temperature < 0:
        raise DFlashError(f"temperature must be a finite number >= 0, got {temperature:g}.")
    if not 0 <= top_p <= 1:
        raise DFlashError(f"top_p must be in [0, 1] (0 disables it), got {top_p:g}.")
    if top_k < 0:
        raise DFlashError(f"top_k must be >= 0 (0 disables it), got {top_k}.")
    if temperature == 0 or top_k == 1 or (top_k == 0 and top_p == 0):
        return SamplingParams(0.0, seed=seed)
    return SamplingParams(temperature, top_p or 1.0, top_k, seed)


def parse_request(get: Getter, *, max_seq_len: int, vocab_rows: int) -> EngineRequest:
    """Engine-model inputs (by engine name) -> a checked request; a bad or unsupported input raises DFlashError."""
    ids = get(INPUT_IDS)
    if ids is None:
        raise DFlashError(f"{INPUT_IDS} is missing; send text_input to the ensemble.")
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise DFlashError(
            f"Send one prompt per request (text_input of shape [1, 1]); got a batch of {ids.shape[0] if ids.ndim else 0}."
        )
    if ids.dtype.kind not in "iu" or ids.size == 0:
        raise DFlashError(
            f"{INPUT_IDS} must be a non-empty list of integer token ids, got {ids.size} values of {ids.dtype}."
        )
    if ids.min() < 0 or ids.max() >= vocab_rows:
        raise DFlashError(
            f"{INPUT_IDS} must be token ids in 0..{vocab_rows - 1}, got {int(ids.min() if ids.min() < 0 else ids.max())}."
        )
    max_tokens = _scalar(get, OUTPUT_LEN, 0, int)
    if not 1 <= max_tokens <= max_seq_len:
        raise DFlashError(f"max_tokens must be between 1 and {max_seq_len}, got {max_tokens}.")
    if ids.size + max_tokens > max_seq_len:
        raise DFlashError(
            f"The prompt is {ids.size} tokens and max_tokens is {max_tokens}, which exceeds max_seq_len {max_seq_len}; "
            f"ask for at most {max(0, max_seq_len - ids.size)} tokens."
        )
    _check_limits(get)
    end_id = _scalar(get, ENGINE["end_id"], None, int)
    if end_id is not None and not 0 <= end_id < vocab_rows:
        raise DFlashError(f"end_id must be a token id in 0..{vocab_rows - 1}, got {end_id}.")
    min_tokens = _scalar(get, ENGINE["min_tokens"], 0, int)
    if min_tokens < 0:
        raise DFlashError(f"min_tokens must be >= 0, got {min_tokens}.")
    return EngineRequest(
        prompt_ids=ids.reshape(-1).tolist(),
        max_tokens=max_tokens,
        sampling=_sampling(get),
        stop_strings=tuple(s for s in _strings(get, ENGINE["stop_words"]) if s),
        stop_token_ids=() if end_id is None else (end_id,),
        min_tokens=min_tokens,
        streaming=_scalar(get, ENGINE["stream"], False, bool),
        exclude_input=_scalar(get, ENGINE["exclude_input_in_output"], True, bool),
    )


def response_arrays(text: str, stats: GenerationStats, times: RequestTimes, cancel_key: str) -> dict[str, np.ndarray]:
    """One engine response: the text since the previous response, and running statistics (batch dim first)."""
    out = {
        TEXT: np.array([[text.encode("utf-8")]], dtype=np.object_),
        CANCEL_KEY: np.array([[cancel_key.encode()]], dtype=np.object_),
    }
    for s in STATS:
        out[s.name] = np.array([[s.value(stats, times)]], dtype=NUMPY[s.dtype])
    return out


def post_name(engine_output: str) -> tuple[str, str]:
    """Postprocessing's input and output names for an engine output it passes through."""
    if engine_output == TEXT:
        return "TEXT_DELTA", "OUTPUT"
    return engine_output.upper(), "OUT_" + engine_output.upper()


def _maps(kind: str, pairs) -> str:
    return "\n".join(f'      {kind} {{ key: "{k}" value: "{v}" }}' for k, v in pairs)


def _list(entries) -> str:
    return ",\n".join("  " + e for e in entries)


def pbtxt_values() -> dict[str, str]:
    """The config.pbtxt blocks rendered from the tables above (Template placeholders of the same names)."""
    ensemble_out = [Tensor(TEXT_OUTPUT, "TYPE_STRING", "-1")] + [Tensor(s.name, s.dtype) for s in STATS]
    return {
        "engine_inputs": _list([t.pbtxt() for t in ENGINE_INPUTS] + [t.pbtxt(t.engine, optional=True) for t in PASSED]),
        "engine_outputs": _list(t.pbtxt() for t in ENGINE_OUTPUTS),
        "ensemble_inputs": _list(t.pbtxt(optional=t.name not in REQUIRED) for t in ENSEMBLE_INPUTS),
        "ensemble_outputs": _list(t.pbtxt() for t in ensemble_out),
        "engine_input_map": _maps("input_map", [(t.engine, t.name) for t in PASSED]),
        "engine_output_map": _maps("output_map", [(t.name, "_" + t.name.upper()) for t in ENGINE_OUTPUTS]),
        "postprocessing_inputs": _list(t.pbtxt(post_name(t.name)[0]) for t in ENGINE_OUTPUTS),
        "postprocessing_outputs": _list(
            Tensor(post_name(t.name)[1], t.dtype, "-1" if t.name == TEXT else t.dims).pbtxt()
            for t in ENGINE_OUTPUTS
            if t.name != CANCEL_KEY
        ),
        "postprocessing_input_map": _maps(
            "input_map", [(post_name(t.name)[0], "_" + t.name.upper()) for t in ENGINE_OUTPUTS]
        ),
        "postprocessing_output_map": _maps(
            "output_map",
            [
                (post_name(t.name)[1], t.name if t.name != TEXT else TEXT_OUTPUT)
                for t in ENGINE_OUTPUTS
                if t.name != CANCEL_KEY
            ],
        ),
    }
