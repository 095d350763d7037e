"""The engine-model wire contract (trtllm_dflash/serving/protocol.py) without a server: parsing, checks, rendered configs."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.serving import protocol
from trtllm_dflash.serving.repository import RepoParams, emit_repository

# The ensemble inputs of TensorRT-LLM's inflight_batcher_llm ensemble (NVIDIA/TensorRT-LLM, 2a9abd9): name, type, dims.
UPSTREAM_INPUTS = """
text_input STRING 1; decoder_text_input STRING 1; max_tokens INT32 1; num_return_sequences INT32 1; bad_words STRING -1;
stop_words STRING -1; exclude_input_in_output BOOL 1; end_id INT32 1; pad_id INT32 1; top_k INT32 1; top_p FP32 1;
temperature FP32 1; length_penalty FP32 1; repetition_penalty FP32 1; min_tokens INT32 1; presence_penalty FP32 1;
frequency_penalty FP32 1; seed UINT64 1; return_log_probs BOOL 1; return_context_logits BOOL 1;
return_generation_logits BOOL 1; return_perf_metrics BOOL 1; return_num_input_tokens BOOL 1;
return_num_output_tokens BOOL 1; beam_width INT32 1; stream BOOL 1; prompt_embedding_table FP16 -1,-1;
prompt_table_extra_id UINT64 1; prompt_vocab_size INT32 1; embedding_bias_words STRING -1; embedding_bias_weights FP32 -1;
lora_task_id UINT64 1; lora_weights FP16 -1,-1; lora_config INT32 -1,3; guided_decoding_guide_type STRING 1;
guided_decoding_guide STRING 1
"""


def request(**inputs):
    """A getter over engine inputs given by ensemble name (input_ids/request_output_len by their own)."""
    arrays = {"input_ids": np.array([[1, 2, 3]], np.int32), "request_output_len": np.array([[8]], np.int32)}
    for name, value in inputs.items():
        arrays[protocol.ENGINE.get(name, name)] = value if isinstance(value, np.ndarray) else np.array([[value]])
    return arrays.get


def parse(**inputs):
    return protocol.parse_request(request(**inputs), max_seq_len=256, vocab_rows=100)


def test_the_ensemble_declares_every_upstream_input_with_its_type_and_dims():
    ours = {t.name: (t.dtype.removeprefix("TYPE_"), t.dims.replace(" ", "")) for t in protocol.ENSEMBLE_INPUTS}
    for entry in UPSTREAM_INPUTS.split(";"):
        name, dtype, dims = entry.split()
        assert ours.get(name) == (dtype, dims), name


def test_defaults_are_greedy_with_our_defaults():
    r = parse()
    assert r.prompt_ids == [1, 2, 3] and r.max_tokens == 8 and r.sampling == SamplingParams()
    assert (r.stop_strings, r.stop_token_ids, r.min_tokens, r.streaming, r.exclude_input) == ((), (), 0, False, True)


@pytest.mark.parametrize(
    "inputs, sampling",
    [
        ({"temperature": np.float32(1.0)}, SamplingParams()),  # TensorRT-LLM: no top_k/top_p means greedy
        ({"temperature": np.float32(0.8), "top_k": np.int32(1), "top_p": np.float32(0.9)}, SamplingParams()),
        ({"temperature": np.float32(0.8), "top_p": np.float32(0.9)}, SamplingParams(0.8, 0.9, 0)),
        (
            {"temperature": np.float32(0.5), "top_k": np.int32(40), "seed": np.uint64(7)},
            SamplingParams(0.5, 1.0, 40, 7),
        ),
        ({"temperature": np.float32(0.0), "top_p": np.float32(1.0)}, SamplingParams()),
    ],
)
def test_sampling_follows_tensorrt_llm(inputs, sampling):
    got = parse(**inputs).sampling
    assert (got.temperature, got.top_p, got.top_k) == pytest.approx(
        (sampling.temperature, sampling.top_p, sampling.top_k)
    )
    assert got.seed == sampling.seed


def test_honoured_inputs():
    r = parse(
        stop_words=np.array([[b"end", b""]], dtype=object),
        end_id=np.int32(5),
        min_tokens=np.int32(4),
        stream=True,
        exclude_input_in_output=False,
        pad_id=np.int32(0),
        length_penalty=np.float32(2.0),
        return_perf_metrics=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    assert (r.stop_strings, r.stop_token_ids, r.min_tokens, r.streaming, r.exclude_input) == (
        ("end",),
        (5,),
        4,
        True,
        False,
    )


NEUTRAL = dict(
    beam_width=np.int32(1),
    num_return_sequences=np.int32(1),
    repetition_penalty=np.float32(1.0),
    presence_penalty=np.float32(0.0),
    frequency_penalty=np.float32(0.0),
    return_log_probs=False,
    return_context_logits=False,
    return_generation_logits=False,
    prompt_table_extra_id=np.uint64(0),
    prompt_vocab_size=np.int32(0),
    decoder_text_input=np.array([[b""]], dtype=object),
    bad_words=np.array([[b""]], dtype=object),
    embedding_bias_words=np.array([[b""]], dtype=object),
    embedding_bias_weights=np.zeros((1, 1), np.float32),
    prompt_embedding_table=np.zeros((1, 0, 0), np.float16),
    lora_weights=np.zeros((1, 0, 0), np.float16),
    lora_config=np.zeros((1, 0, 3), np.int32),
    guided_decoding_guide_type=np.array([[b""]], dtype=object),
    guided_decoding_guide=np.array([[b""]], dtype=object),
)


def test_neutral_values_pass():
    assert parse(**NEUTRAL).sampling.greedy


UNSUPPORTED = [
    (
        "beam_width",
        np.int32(4),
        "beam_width 4 is not supported: DFlash speculative decoding runs one beam; send beam_width 1.",
    ),
    ("num_return_sequences", np.int32(2), "num_return_sequences 2 is not supported"),
    ("repetition_penalty", np.float32(1.2), "repetition_penalty 1.2 is not supported"),
    ("presence_penalty", np.float32(0.5), "presence_penalty 0.5 is not supported"),
    ("frequency_penalty", np.float32(0.5), "frequency_penalty 0.5 is not supported"),
    ("return_log_probs", True, "return_log_probs true is not supported"),
    ("return_context_logits", True, "return_context_logits true is not supported"),
    ("return_generation_logits", True, "return_generation_logits true is not supported"),
    ("prompt_table_extra_id", np.uint64(3), "prompt_table_extra_id 3 is not supported"),
    ("prompt_vocab_size", np.int32(10), "prompt_vocab_size 10 is not supported"),
    ("decoder_text_input", np.array([[b"hola"]], dtype=object), "decoder_text_input 'hola' is not supported"),
    ("bad_words", np.array([[b"x"]], dtype=object), "bad_words 'x' is not supported"),
    ("embedding_bias_words", np.array([[b"x"]], dtype=object), "embedding_bias_words 'x' is not supported"),
    ("embedding_bias_weights", np.array([[0.5]], np.float32), "embedding_bias_weights 0.5 is not supported"),
    ("prompt_embedding_table", np.ones((1, 2, 4), np.float16), "A non-empty prompt_embedding_table is not supported"),
    ("lora_task_id", np.uint64(0), "lora_task_id 0 is not supported: LoRA adapters"),
    ("lora_weights", np.ones((1, 2, 8), np.float16), "A non-empty lora_weights is not supported"),
    ("lora_config", np.ones((1, 2, 3), np.int32), "A non-empty lora_config is not supported"),
    (
        "guided_decoding_guide_type",
        np.array([[b"json"]], dtype=object),
        "guided_decoding_guide_type 'json' is not supported",
    ),
    ("guided_decoding_guide", np.array([[b"{}"]], dtype=object), "guided_decoding_guide '{}' is not supported"),
]


@pytest.mark.parametrize("name, value, message", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_values_are_one_sentence(name, value, message):
    with pytest.raises(DFlashError) as e:
        parse(**{name: value})
    text = str(e.value)
    assert text.startswith(message) and text.endswith(".") and text.count(". ") == 0, text


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"temperature": np.float32(-1)}, "temperature must be a finite number >= 0, got -1."),
        ({"top_p": np.float32(1.5)}, "top_p must be in [0, 1] (0 disables it), got 1.5."),
        ({"top_k": np.int32(-3)}, "top_k must be >= 0 (0 disables it), got -3."),
        ({"end_id": np.int32(100)}, "end_id must be a token id in 0..99, got 100."),
        ({"min_tokens": np.int32(-1)}, "min_tokens must be >= 0, got -1."),
        ({"request_output_len": np.int32(0)}, "max_tokens must be between 1 and 256, got 0."),
        ({"beam_width": np.array([[1, 1]], np.int32)}, "beam_width must hold one value per request, got shape [1, 2]."),
        ({"input_ids": np.array([[1], [2]], np.int32)}, "Send one prompt per request"),
    ],
)
def test_bad_values(inputs, message):
    with pytest.raises(DFlashError, match=re.escape(message)):
        parse(**inputs)


def test_response_arrays_carry_the_standard_statistics():
    stats = GenerationStats(
        prompt_tokens=7, num_tokens=9, steps=4, drafted_tokens=12, accepted_tokens=4, finish_reason="length"
    )
    times = protocol.RequestTimes()
    times.schedule()
    times.token()
    out = protocol.response_arrays("hé", stats, times, "k")
    assert set(out) == {t.name for t in protocol.ENGINE_OUTPUTS}
    value = {k: v.reshape(-1)[0] for k, v in out.items()}
    assert value["output_text"].decode() == "hé" and value["finish_reason"] == b"length"
    assert (value["num_input_tokens"], value["num_output_tokens"], value["acceptance_rate"]) == (
        7,
        9,
        pytest.approx(1 / 3),
    )
    assert value["acceptance_length"] == pytest.approx(2.0) and value["batch_index"] == value["sequence_index"] == 0
    assert (
        0
        < value["arrival_time_ns"]
        <= value["first_scheduled_time_ns"]
        <= value["first_token_time_ns"]
        == value["last_token_time_ns"]
    )
    assert all(
        v.shape == (1, 1) and v.dtype == protocol.NUMPY[t.dtype] for t in protocol.ENGINE_OUTPUTS for v in [out[t.name]]
    )


@pytest.mark.parametrize("engine", ["dflash", "tensorrt_llm"])
def test_rendered_repository_names_the_engine_and_declares_the_contract(tmp_path, engine):
    emit_repository(tmp_path / "repo", RepoParams(2, 256, "tok", True, engine_model=engine))
    ensemble = (tmp_path / "repo/ensemble/config.pbtxt").read_text()
    assert f'model_name: "{engine}"' in ensemble
    assert all(f'name: "{t.name}"' in ensemble for t in protocol.ENSEMBLE_INPUTS)
    assert all(f'name: "{s.name}"' in ensemble for s in protocol.STATS)
    config = (tmp_path / f"repo/{engine}/config.pbtxt").read_text()
    assert all(f'name: "{t.engine}"' in config for t in protocol.PASSED)
    assert all(f'name: "{t.name}"' in config for t in protocol.ENGINE_OUTPUTS)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"input_ids": np.array([[1, 100]], np.int32)}, "input_ids must be token ids in 0..99, got 100."),
        ({"input_ids": np.array([[-1, 2]], np.int32)}, "input_ids must be token ids in 0..99, got -1."),
        (
            {"input_ids": np.zeros((1, 0), np.int32)},
            "input_ids must be a non-empty list of integer token ids, got 0 values of int32.",
        ),
        (
            {"input_ids": np.array([[1.5]], np.float32)},
            "input_ids must be a non-empty list of integer token ids, got 1 values of float32.",
        ),
        (
            {"input_ids": np.ones((1, 250), np.int32), "request_output_len": np.int32(8)},
            "The prompt is 250 tokens and max_tokens is 8, which exceeds max_seq_len 256; ask for at most 6 tokens.",
        ),
        ({"request_output_len": np.array([[b"8"]], dtype=object)}, "max_tokens must be an integer, got object data."),
        ({"top_k": np.float32(2.5)}, "top_k must be an integer, got float32 data."),
        ({"temperature": np.array([[b"hot"]], dtype=object)}, "temperature must be a number, got object data."),
        ({"temperature": np.float32("nan")}, "temperature must be a finite number >= 0, got nan."),
        ({"beam_width": np.array([[b"2"]], dtype=object)}, "beam_width must be an integer, got object data."),
        ({"stream": np.array([[b"yes"]], dtype=object)}, "stream must be a boolean, got object data."),
        ({"stop_words": np.array([[b"\xff\xfe"]], dtype=object)}, "stop_words is not valid UTF-8."),
        ({"stop_words": np.array([[b"x"] * 65], dtype=object)}, "stop_words holds 65 strings; send at most 64."),
        (
            {"stop_words": np.array([[b"x" * 1025]], dtype=object)},
            "stop_words holds a string of 1025 characters; send at most 1024 per string.",
        ),
        ({"bad_words": np.array([[b"\xc3"]], dtype=object)}, "bad_words is not valid UTF-8."),
    ],
)
def test_the_boundary_checks_types_shapes_ranges_and_lengths(inputs, message):
    with pytest.raises(DFlashError) as e:
        parse(**inputs)
    assert str(e.value) == message


# Any array of any of these types and shapes, for any subset of the engine's inputs.
ARRAYS = st.one_of(
    st.builds(
        lambda dt, shape, seed: np.random.default_rng(seed).integers(-5, 300, shape).astype(dt),
        st.sampled_from([np.int32, np.int64, np.uint64, np.uint8, np.bool_, np.float32, np.float16]),
        st.sampled_from([(1, 1), (1, 3), (1, 0), (2, 1), (), (1, 1, 2)]),
        st.integers(0, 1 << 16),
    ),
    st.sampled_from(
        [np.float32("nan"), np.float32("inf"), np.float32(-0.0), np.uint64(1 << 63), np.int64(-(1 << 40))]
    ).map(lambda v: np.array([[v]])),
    st.lists(st.binary(max_size=6), min_size=0, max_size=3).map(lambda bs: np.array([bs], dtype=object)),
)
NAMES = sorted({protocol.INPUT_IDS, protocol.OUTPUT_LEN} | set(protocol.ENGINE.values()))


@settings(max_examples=300, deadline=None, database=None)  # no example database written into the work tree
@given(st.dictionaries(st.sampled_from(NAMES), ARRAYS, max_size=6))
def test_fuzz_any_request_is_parsed_or_refused_in_one_sentence(arrays):
    """The engine models answer DFlashError with an error response and keep serving; anything else would be a bug."""
    base = {"input_ids": np.array([[1, 2, 3]], np.int32), "request_output_len": np.array([[8]], np.int32)}
    try:
        r = protocol.parse_request({**base, **arrays}.get, max_seq_len=256, vocab_rows=100)
    except DFlashError as e:
        assert "\n" not in str(e) and str(e).endswith(".")
    else:
        assert r.max_tokens >= 1 and len(r.prompt_ids) + r.max_tokens <= 256 and all(0 <= i < 100 for i in r.prompt_ids)


def test_postprocessing_imports_no_torch():
    """Triton starts the postprocessing stub beside the dflash model's: importing torch there (about 3.5 s of CPU)
    slowed every server start on a 2-core machine."""
    import subprocess
    import sys

    code = "import sys, trtllm_dflash.serving.protocol, trtllm_dflash.serving.cancel; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )
