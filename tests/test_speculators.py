"""vLLM's speculators format, both ways, on the shipped SmolLM2 draft and the real target: the round trip keeps every
tensor, the speculators config says what upstream's converter writes, and a speculators checkpoint given where a draft
is expected (the runtime, `build`) decodes the target's greedy tokens exactly as the z-lab original does."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from trtllm_dflash.cli import main
from trtllm_dflash.config import SamplingParams
from trtllm_dflash.engine.batch import speculative_stream
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import check_draft, load_draft
from trtllm_dflash.models.speculators import to_speculators, to_zlab, zlab_view
from trtllm_dflash.resolve import DRAFTS_DIR

SHIPPED = DRAFTS_DIR / "smollm2-135m"


@pytest.fixture(scope="module")
def spec_dir(target_dir, tmp_path_factory):
    return to_speculators(SHIPPED, tmp_path_factory.mktemp("spec") / "draft", target_dir, "HuggingFaceTB/SmolLM2-135M")


def test_the_speculators_config_is_what_upstreams_converter_writes(spec_dir, target_dir):
    spec = json.loads((spec_dir / "config.json").read_text())
    zlab = json.loads((SHIPPED / "config.json").read_text())
    ids = zlab["dflash_config"]["target_layer_ids"]
    assert spec["speculators_model_type"] == "dflash" and spec["architectures"] == ["DFlashSpeculator"]
    assert spec["aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
    assert spec["mask_token_id"] == zlab["dflash_config"]["mask_token_id"]
    method = spec["speculators_config"]["proposal_methods"][0]
    assert method["proposal_type"] == "greedy" and method["speculative_tokens"] == spec["block_size"] - 1
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M"
    assert "dflash_config" not in spec["transformer_layer_config"]
    assert spec["transformer_layer_config"]["num_hidden_layers"] == zlab["num_hidden_layers"]
    tensors = load_file(spec_dir / "model.safetensors")
    target = load_file(target_dir / "model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(tensors["lm_head.weight"], target.get("lm_head.weight", target["model.embed_tokens.weight"]))


def test_the_round_trip_keeps_every_tensor_and_the_drafts_facts(spec_dir, tmp_path):
    back = to_zlab(spec_dir, tmp_path / "zlab")
    original, again = load_file(SHIPPED / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)
    a, b = check_draft(SHIPPED), check_draft(back)
    for field in ("block_size", "mask_token_id", "target_layer_ids", "hidden_size", "num_hidden_layers", "vocab_size"):
        assert getattr(a, field) == getattr(b, field), field
    assert (back / "draft_vocab.json").read_bytes() == (SHIPPED / "draft_vocab.json").read_bytes()


def test_a_speculators_draft_decodes_the_targets_tokens_as_the_original_does(spec_dir, target, tmp_path):
    prompt = target.tokenizer.encode("Natalia sold 48 clips in April and half as many in May. How many in total?")
    outputs = []
    for path in (SHIPPED, zlab_view(spec_dir, tmp_path)):
        draft = load_draft(path)
        target.set_taps(draft.config.target_layer_ids)
        stats = GenerationStats()
        stream = speculative_stream(
            target, draft, prompt, 40, draft.config.block_size, SamplingParams(), frozenset(), stats
        )
        outputs.append(([t for step in stream for t in step], stats.accepted_tokens))
    plain = [
        t
        for step in speculative_stream(target, None, prompt, 40, 1, SamplingParams(), frozenset(), GenerationStats())
        for t in step
    ]
    assert outputs[0] == outputs[1] and outputs[0][0] == plain
    assert outputs[0][1] > 0  # the converted draft's guesses were accepted, as the original's


def test_build_takes_a_speculators_draft(spec_dir, tmp_path):
    result = CliRunner().invoke(main, ["build", "--draft", str(spec_dir), "--output", str(tmp_path / "b"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "b").exists()


def test_bad_speculators_input_gets_one_sentence(spec_dir, tmp_path):
    config = json.loads((spec_dir / "config.json").read_text())
    anchored = tmp_path / "anchored"
    anchored.mkdir()
    (anchored / "config.json").write_text(json.dumps(config | {"sample_from_anchor": True}))
    (anchored / "model.safetensors").write_bytes((spec_dir / "model.safetensors").read_bytes())
    with pytest.raises(DFlashError, match="sample_from_anchor"):
        to_zlab(anchored, tmp_path / "out1")
    reduced = tmp_path / "reduced"
    reduced.mkdir()
    (reduced / "config.json").write_text(json.dumps(config))
    save_file(
        load_file(spec_dir / "model.safetensors") | {"d2t": torch.zeros(4, dtype=torch.long)},
        reduced / "model.safetensors",
    )
    with pytest.raises(DFlashError, match="reduced vocabulary"):
        to_zlab(reduced, tmp_path / "out2")
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()
    result = CliRunner().invoke(main, ["convert-draft", str(SHIPPED), str(tmp_path / "out3")])
    assert result.exit_code != 0 and "--target" in result.output and "Traceback" not in result.output
