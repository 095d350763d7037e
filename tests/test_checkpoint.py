"""The public z-lab draft format: what others write loads here, what we write loads there."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_dflash.config import DraftConfig
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import load_draft, read_draft_config, save_draft
from trtllm_dflash.models.draft import DFlashDraftModel

FIXTURES = Path(__file__).parent / "fixtures"


def write_third_party(tmp_path, fixture):
    """A checkpoint laid out as released drafts are: their config.json verbatim, bare tensor names, bf16."""
    raw = json.loads((FIXTURES / fixture).read_text())
    model = DFlashDraftModel(DraftConfig.from_dict(raw))
    model.init_weights(generator=torch.Generator().manual_seed(3))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors"
    )
    return raw


def test_released_qwen3_8b_b16_config_loads(tmp_path):
    write_third_party(tmp_path, "qwen3-8b-dflash-b16-tiny.json")
    draft = load_draft(tmp_path)
    c = draft.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, 151669, [1, 9, 17, 25, 33])
    assert c.rope_theta == 1e6 and c.num_hidden_layers == 5 and c.num_key_value_heads == 2
    assert draft.fc.weight.shape == (64, 5 * 64)
    assert not any(c.layer_is_causal(i) or c.layer_window(i) for i in range(5))
    assert sorted(load_file(tmp_path / "model.safetensors"))[:3] == [
        "fc.weight",
        "hidden_norm.weight",
        "layers.0.input_layernorm.weight",
    ]


def test_newer_layout_block_size_in_dflash_config_and_swa(tmp_path):
    write_third_party(tmp_path, "qwen3.5-4b-dflash-tiny.json")
    c = load_draft(tmp_path).config
    assert c.block_size == 16 and len(c.target_layer_ids) == 8 and c.num_hidden_layers == 6
    assert [c.layer_is_causal(i) for i in range(6)] == [True] * 5 + [False]
    assert c.layer_window(0) == 4096 and c.layer_window(5) is None


@pytest.mark.parametrize("fixture", ["qwen3-8b-dflash-b16-tiny.json", "qwen3.5-4b-dflash-tiny.json"])
def test_round_trip_keeps_weights_and_config(tmp_path, fixture):
    (tmp_path / "src").mkdir()
    raw = write_third_party(tmp_path / "src", fixture)
    draft = load_draft(tmp_path / "src", torch.float32)
    save_draft(draft, tmp_path / "out", dtype=torch.bfloat16)
    again = load_draft(tmp_path / "out", torch.float32)
    for (name, a), (_, b) in zip(draft.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in (
        "architectures",
        "model_type",
        "auto_map",
        "dflash_config",
        "layer_types",
        "num_target_layers",
        "head_dim",
        "vocab_size",
    ):
        assert written[key] == raw[key], key
    assert ("block_size" in written) == ("block_size" in raw)
    assert written["rope_theta"] == raw["rope_theta"]
    reread, original = DraftConfig.from_dict(written), draft.config
    for c in (reread, original):
        for key in ("dtype", "torch_dtype"):
            c.extra.pop(key, None)
    assert reread == original


@pytest.mark.parametrize("value", ["yes", 1.5, -0.1, True])
def test_short_blocks_is_a_share_or_one_sentence(value):
    """dflash_config.short_blocks (train-draft --short-blocks) decides how the runtime drafts: a share from 0 to 1, kept
    through a round trip, or the config is refused in one sentence."""
    raw = json.loads((FIXTURES / "qwen3-8b-dflash-b16-tiny.json").read_text())
    assert DraftConfig.from_dict(raw).short_blocks == 0.0
    raw["dflash_config"]["short_blocks"] = 0.5
    cfg = DraftConfig.from_dict(raw)
    assert cfg.short_blocks == 0.5 and DraftConfig.from_dict(cfg.to_dict()).short_blocks == 0.5
    raw["dflash_config"]["short_blocks"] = value
    with pytest.raises(DFlashError, match="short_blocks .* not a share from 0 to 1"):
        DraftConfig.from_dict(raw)


def test_written_checkpoint_is_what_engines_expect(tmp_path, target):
    """TensorRT-LLM/vLLM/SGLang read: DFlashDraftModel + qwen3 config, bare names, no embedding or head."""
    from transformers import AutoConfig

    cfg = DraftConfig.for_target(
        target.text_config, vocab_rows=target.vocab_rows, num_layers=2, block_size=8, mask_token_id=16
    )
    save_draft(DFlashDraftModel(cfg), tmp_path / "d")
    hf = AutoConfig.from_pretrained(tmp_path / "d")
    assert hf.model_type == "qwen3" and hf.architectures == ["DFlashDraftModel"]
    assert hf.dflash_config == {"mask_token_id": 16, "target_layer_ids": cfg.target_layer_ids} and hf.block_size == 8
    names = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)
    assert len(names) == 3 + 11 * 2  # 11 tensors per layer, as in released drafts
    assert not list((tmp_path).glob(".d.tmp*"))  # the atomic write left nothing behind


def test_pickle_and_broken_checkpoints_are_refused(tmp_path):
    write_third_party(tmp_path, "qwen3-8b-dflash-b16-tiny.json")
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(DFlashError, match="pickle"):
        load_draft(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DFlashError, match="not a readable safetensors"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(DFlashError, match="not readable JSON"):
        read_draft_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(DFlashError, match="not a DFlashDraftModel"):
        read_draft_config(tmp_path)


def test_tensor_names_and_shapes_must_match_config(tmp_path):
    raw = write_third_party(tmp_path, "qwen3-8b-dflash-b16-tiny.json")
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = torch.zeros(4, 64)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(DFlashError, match="must not carry its own"):
        load_draft(tmp_path)
    del state["lm_head.weight"]
    state["fc.weight"] = torch.zeros(64, 3 * 64)  # fc input width does not match 5 taps x hidden
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(DFlashError, match="fc.weight has shape"):
        load_draft(tmp_path)
    assert raw["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
