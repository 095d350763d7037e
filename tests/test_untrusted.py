"""Untrusted checkpoint files (trtllm_dflash/untrusted.py): corrupt, truncated, lying, absurd or escaping input is
refused with one sentence before any loader opens it; fuzzed input never gets past as anything but a DFlashError."""

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import load_draft, read_draft_config
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import DRAFTS_DIR, resolve_target
from trtllm_dflash.untrusted import (
    DTYPE_BITS,
    check_checkpoint_dir,
    check_config_values,
    inside,
    read_hf_config,
    read_json,
    read_safetensors_header,
)

FIXTURES = Path(__file__).parent / "fixtures"
# A few seconds per fuzz test; database=None: no example database written into the work tree.
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def library_view(path):
    """What the safetensors library itself reads: name -> (dtype, shape), or None if it refuses the file."""
    try:
        with safe_open(path, framework="numpy") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception:
        return None


def our_view(path):
    return {k: (t.dtype, t.shape) for k, t in read_safetensors_header(path).items()}


def small_file(path):
    save_file(
        {
            "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.ones(4, dtype=torch.bfloat16),
            "c": torch.zeros(3, dtype=torch.int64),
        },
        path,
        metadata={"format": "pt"},
    )
    return path.read_bytes()


def rewrite_header(blob: bytes, edit) -> bytes:
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n :]


def test_real_checkpoints_read_exactly_as_the_library_reads_them(target_dir):
    for path in (target_dir / "model.safetensors", DRAFTS_DIR / "smollm2-135m" / "model.safetensors"):
        assert our_view(path) == library_view(path) and len(our_view(path)) > 10
    check_checkpoint_dir(target_dir, "Target")
    check_checkpoint_dir(DRAFTS_DIR / "smollm2-135m", "Draft")


def _shift(h, name, delta):
    h[name]["data_offsets"] = [o + delta for o in h[name]["data_offsets"]]


CORRUPTIONS = {
    "truncated by one byte": lambda b: b[:-1],
    "truncated inside the header": lambda b: b[:20],
    "shorter than the length field": lambda b: b[:5],
    "trailing bytes": lambda b: b + b"\0" * 8,
    "header length beyond the file": lambda b: struct.pack("<Q", len(b)) + b[8:],
    "header length of 2^63": lambda b: struct.pack("<Q", 1 << 63) + b[8:],
    "header not JSON": lambda b: b[:8] + b"\xff" * (len(b) - 8),
    "shape lies about the size": lambda b: rewrite_header(b, lambda h: h["a"].update(shape=[3, 3])),
    "overlapping tensors": lambda b: rewrite_header(
        b, lambda h: h["b"].update(data_offsets=h["a"]["data_offsets"][:1] + [h["a"]["data_offsets"][0] + 8])
    ),
    "a gap between tensors": lambda b: rewrite_header(b, lambda h: [_shift(h, k, 4) for k in h if k != "__metadata__"]),
    "unknown dtype": lambda b: rewrite_header(b, lambda h: h["c"].update(dtype="Q64")),
    "negative dimension": lambda b: rewrite_header(b, lambda h: h["c"].update(shape=[-3])),
    "offsets as strings": lambda b: rewrite_header(b, lambda h: h["c"].update(data_offsets=["0", "24"])),
    "metadata not strings": lambda b: rewrite_header(b, lambda h: h.update(__metadata__={"format": 1})),
    "header a list": lambda b: struct.pack("<Q", 2) + b"[]",
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_safetensors_are_one_sentence_and_the_library_agrees(tmp_path, corruption):
    good = small_file(tmp_path / "ok.safetensors")
    assert our_view(tmp_path / "ok.safetensors") == library_view(tmp_path / "ok.safetensors")
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(CORRUPTIONS[corruption](good))
    with pytest.raises(DFlashError, match="is not a readable safetensors file") as e:
        read_safetensors_header(bad)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")
    assert library_view(bad) is None  # each of these really is broken, not a strictness of ours


@st.composite
def safetensors_blobs(draw):
    """Mostly well-formed files whose header may lie a little: offsets, sizes, lengths, trailing data."""
    entries, offset = {}, 0
    lie = lambda: draw(st.sampled_from([0] * 8 + [-3, -1, 1, 2]))  # noqa: E731
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        nbytes = math.prod(shape) * DTYPE_BITS[dtype] // 8
        start = offset + lie()
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + nbytes + lie()]}
        offset = entries[f"t{i}"]["data_offsets"][1]
    header = json.dumps(entries).encode() + b" " * draw(st.integers(0, 7))
    size = max(0, offset + lie())
    data = draw(st.binary(min_size=size, max_size=size))
    return struct.pack("<Q", max(0, len(header) + lie())) + header + data


@FUZZ
@given(blob=safetensors_blobs())
def test_fuzz_headers_we_accept_are_exactly_what_the_library_accepts(tmp_path_factory, blob):
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    path.write_bytes(blob)
    try:
        ours = our_view(path)
    except DFlashError:
        ours = None
    theirs = library_view(path)
    assert ours == theirs


@FUZZ
@given(
    blob=st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=200).map(lambda b: struct.pack("<Q", len(b)) + b),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        ).map(lambda v: (lambda raw: struct.pack("<Q", len(raw)) + raw)(json.dumps(v).encode())),
    )
)
def test_fuzz_any_bytes_are_a_header_or_one_sentence(tmp_path_factory, blob):
    path = tmp_path_factory.getbasetemp() / "bytes.safetensors"
    path.write_bytes(blob)
    try:
        read_safetensors_header(path)
    except DFlashError as e:
        assert "\n" not in str(e)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8,
)
DRAFT_CONFIG = json.loads((FIXTURES / "qwen3-8b-dflash-b16-tiny.json").read_text())


@FUZZ
@given(
    top=st.dictionaries(st.sampled_from(sorted(DRAFT_CONFIG)), JSON_VALUES, max_size=3),
    dflash=st.dictionaries(
        st.sampled_from(["mask_token_id", "target_layer_ids", "block_size", "short_blocks"]), JSON_VALUES, max_size=2
    ),
)
def test_fuzz_draft_configs_are_a_config_or_one_sentence(tmp_path_factory, top, dflash):
    d = tmp_path_factory.getbasetemp() / "fuzzdraft"
    d.mkdir(exist_ok=True)
    raw = {**DRAFT_CONFIG, **top}
    if isinstance(raw.get("dflash_config"), dict):
        raw["dflash_config"] = {**raw["dflash_config"], **dflash}
    (d / "config.json").write_text(json.dumps(raw))
    try:
        cfg = read_draft_config(d)
    except DFlashError as e:
        assert "\n" not in str(e)
    else:  # what is accepted is in range
        assert 1 <= cfg.num_hidden_layers <= 1024 and cfg.hidden_size >= 1 and 1 <= cfg.block_size <= 4096
        assert 0 <= cfg.short_blocks <= 1


@FUZZ
@given(
    config=st.dictionaries(
        st.sampled_from(
            [
                "hidden_size",
                "num_hidden_layers",
                "vocab_size",
                "rms_norm_eps",
                "text_config",
                "layer_types",
                "max_position_embeddings",
                "head_dim",
            ]
        ),
        JSON_VALUES,
        max_size=4,
    )
)
def test_fuzz_config_value_checks(config):
    try:
        check_config_values(config, "config.json")
    except DFlashError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_size", -64),
        ("num_hidden_layers", 10**9),
        ("vocab_size", 0),
        ("rms_norm_eps", float("nan")),
        ("head_dim", "16"),
        ("num_hidden_layers", True),
    ],
)
def test_absurd_config_values_are_refused_for_drafts_and_targets(tmp_path, target_dir, key, value):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({**DRAFT_CONFIG, key: value}))
    with pytest.raises(DFlashError, match=f"sets {key} to"):
        read_draft_config(draft)
    target = _target_copy(target_dir, tmp_path / "target")
    (target / "config.json").unlink()
    (target / "config.json").write_text(
        json.dumps({**json.loads((target_dir / "config.json").read_text()), key: value})
    )
    with pytest.raises(DFlashError, match=f"sets {key} to"):
        TargetModel.load(target)


def _target_copy(target_dir, dst, weights: bytes | None = None):
    """The real target's files, hard-linked (no copy of the weights), with other weights if given."""
    dst.mkdir()
    for f in target_dir.iterdir():
        if f.name != "model.safetensors" or weights is None:
            os.link(f, dst / f.name)
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    return dst


def test_symlinks_must_stay_inside_the_model_directory(tmp_path, target_dir):
    target = _target_copy(target_dir, tmp_path / "t")
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    (target / "generation_config.json").unlink()
    (target / "generation_config.json").symlink_to(outside)
    with pytest.raises(DFlashError, match="is a symlink to .*secret.json, outside the model directory"):
        check_checkpoint_dir(target, "Target")
    with pytest.raises(DFlashError, match="outside the model directory"):
        resolve_target(str(target))
    (target / "generation_config.json").unlink()
    (target / "generation_config.json").symlink_to(target / "config.json")  # inside: fine
    check_checkpoint_dir(target, "Target")
    # A Hugging Face cache snapshot links its files to the repository's blobs/: that is inside the model.
    repo = tmp_path / "models--x" / "snapshots" / "abc"
    repo.mkdir(parents=True)
    repo.parent.parent.joinpath("blobs").mkdir()
    for f in target.iterdir():
        blob = repo.parent.parent / "blobs" / f.name
        os.link(f.resolve(), blob)
        (repo / f.name).symlink_to(Path("../../blobs") / f.name)
    check_checkpoint_dir(repo, "Target")


def test_shard_index_paths_cannot_leave_the_directory(tmp_path):
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DRAFT_CONFIG))
    small_file(d / "model-00001.safetensors")
    for shard, message in (
        ("../../etc/passwd.safetensors", "leaves that directory"),
        ("/etc/x.safetensors", "leaves that directory"),
        ("model-00002.safetensors", "not a safetensors file in"),
        ("config.json", "not a safetensors file in"),
    ):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": shard}}))
        with pytest.raises(DFlashError, match=message):
            load_draft(d)
    with pytest.raises(DFlashError, match="leaves that directory"):
        inside("a/../../b", tmp_path)
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(DFlashError, match="outside that directory"):
        inside("link/passwd", tmp_path)


def test_pickle_only_and_special_file_targets_are_refused(tmp_path, target_dir):
    target = _target_copy(target_dir, tmp_path / "t")
    os.rename(target / "model.safetensors", target / "pytorch_model.bin")
    with pytest.raises(DFlashError, match="pickle weights"):
        TargetModel.load(target)
    os.mkfifo(target / "model.safetensors")  # would block a reader forever
    with pytest.raises(DFlashError, match="is not a regular file"):
        TargetModel.load(target)


def test_generate_on_a_truncated_target_is_one_sentence_exit_2(tmp_path, target_dir):
    """The issue's reproduction: a truncated model.safetensors ended `trtdflash generate` in a SafetensorError traceback."""
    weights = (target_dir / "model.safetensors").open("rb").read(1 << 20)
    target = _target_copy(target_dir, tmp_path / "t", weights=weights)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtllm_dflash.cli",
            "generate",
            "--target",
            str(target),
            "--no-draft",
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "is not a readable safetensors file" in lines[0], (
        r.stderr
    )
    assert "header describes" in lines[0]


@FUZZ
@given(
    top=st.dictionaries(
        st.sampled_from(
            [
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "rope_theta",
                "rope_scaling",
                "rope_parameters",
                "attention_bias",
                "tie_word_embeddings",
                "model_type",
                "architectures",
                "auto_map",
                "layer_types",
                "torch_dtype",
                "max_position_embeddings",
            ]
        ),
        JSON_VALUES,
        max_size=3,
    )
)
def test_fuzz_target_configs_are_a_config_or_one_sentence(tmp_path_factory, target_dir, top):
    """transformers' strict config classes raise their own errors; the target reader turns every one into a sentence."""
    d = tmp_path_factory.getbasetemp() / "fuzztarget"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**json.loads((target_dir / "config.json").read_text()), **top}))
    try:
        check_config_values(read_json(d / "config.json"), d / "config.json")
        read_hf_config(d)
    except DFlashError as e:
        assert "\n" not in str(e)


def test_convert_checks_its_input_before_reading_it(tmp_path):
    """A draft whose weights are a symlink to a file elsewhere (safetensors would read it happily) is refused up front."""
    from trtllm_dflash.convert import ConvertOptions, convert_checkpoint

    draft = tmp_path / "draft"
    shutil.copytree(DRAFTS_DIR / "smollm2-135m", draft)
    (draft / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (draft / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(
        DFlashError, match="model.safetensors is a symlink to .*elsewhere.safetensors, outside the model directory"
    ):
        convert_checkpoint(
            ConvertOptions(model=str(draft), quant="fp8", output=tmp_path / "out"), progress=lambda m: None
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "elsewhere.safetensors"]
