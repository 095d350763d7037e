"""`trtdflash generate`: real runs, and one clear sentence with a non-zero exit for every bad input."""

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import make_random_draft

from trtllm_dflash.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_generate_json_autoregressive_and_with_draft_agree(random_draft_dir):
    base = ["generate", "--prompt", "What is 12 times 7?", "--max-new-tokens", "24", "--dtype", "fp32", "--json"]
    ar = run(*base, "--no-draft")
    assert ar.exit_code == 0, ar.output
    ar = json.loads(ar.output.strip().splitlines()[-1])
    assert ar["acceptance_length"] == 1.0 and ar["block_size"] == 1
    spec = json.loads(run(*base, "--draft", str(random_draft_dir), "--block-size", "8").output.strip().splitlines()[-1])
    for key in ("text", "token_ids", "num_tokens", "acceptance_length", "tokens_per_second", "steps"):
        assert key in spec
    assert spec["token_ids"] == ar["token_ids"] and spec["text"] == ar["text"] and spec["block_size"] == 8
    assert spec["num_tokens"] == len(spec["token_ids"])


def test_the_prompt_comes_as_the_argument_as_an_option_or_from_stdin():
    """`trtdflash generate "..."` as `llm` and `ollama run` take a prompt; `--prompt` and `-` (stdin) write the same."""
    base = ["generate", "--no-draft", "--max-new-tokens", "6", "--dtype", "fp32", "--json"]
    out = [
        CliRunner().invoke(main, [*base, *args], input=stdin)
        for args, stdin in (
            (["Name a fruit."], None),
            (["--prompt", "Name a fruit."], None),
            (["-"], "Name a fruit."),
            (["Name a tree."], None),
        )
    ]
    assert all(r.exit_code == 0 for r in out), [r.output for r in out]
    ids = [json.loads(r.output.strip().splitlines()[-1])["token_ids"] for r in out]
    assert ids[0] == ids[1] == ids[2] != ids[3]


@pytest.mark.parametrize("command", ["generate", "client"])
@pytest.mark.parametrize(
    "args, message", [([], "Missing the prompt"), (["hi", "--prompt", "hi"], "Give the prompt once")]
)
def test_a_missing_or_doubled_prompt_gets_one_sentence(command, args, message):
    r = run(command, *args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_generate_says_how_the_draft_holds_its_weights():
    """bf16 on a CPU with AVX2 alone keeps the draft's weights as int8 by default (`int8_weights`), elsewhere bf16;
    `--no-int8-draft` keeps them bf16 anywhere; the text is the same either way."""
    from trtllm_dflash.kernels import bf16_gemm

    base = ["generate", "--prompt", "Name a primary colour.", "--max-new-tokens", "12", "--dtype", "bf16", "--json"]
    default, kept = (
        json.loads(run(*base, *extra).output.strip().splitlines()[-1]) for extra in ((), ("--no-int8-draft",))
    )
    assert (
        default["draft_weights"] == ("int8" if bf16_gemm.int8_weights() else "bf16") and kept["draft_weights"] == "bf16"
    )
    assert default["token_ids"] == kept["token_ids"]
    assert json.loads(run(*base, "--no-draft").output.strip().splitlines()[-1])["draft_weights"] is None


def test_generate_streams_text_and_prints_summary(random_draft_dir):
    r = run(
        "generate",
        "--draft",
        str(random_draft_dir),
        "--prompt",
        "Say hello.",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.7",
        "--seed",
        "1",
    )
    assert r.exit_code == 0, r.output
    assert "acceptance length" in r.output and "tok/s" in r.output


def bad(tmp_path, target, name, **overrides):
    return str(make_random_draft(target, tmp_path / name, **overrides))


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("not_json", "not readable JSON"),
        ("pickle", "pickle weights"),
        ("hidden", "hidden size 64 differs"),
        ("vocab", "vocab size 1000 differs"),
        ("fc", "fc.weight has shape"),
        ("rope", "RoPE"),
        ("layers", "taps target layers [40]"),
        ("mask", "mask_token_id 60000"),
        ("block", "exceeds the draft's trained block size"),
        ("long_prompt", "context window"),
        ("unknown_target", "Unknown target"),
        ("top_p", "top_p must be in (0, 1]"),
        ("max_tokens", "max_new_tokens must be at least 1"),
    ],
)
def test_bad_input_gets_one_sentence(tmp_path, target, random_draft_dir, case, message):
    args = ["generate", "--prompt", "hi", "--max-new-tokens", "4"]
    draft = str(random_draft_dir)
    if case == "missing":
        draft = str(tmp_path / "nope")
    elif case == "not_json":
        draft = bad(tmp_path, target, "d")
        (tmp_path / "d" / "config.json").write_text("{not json")
    elif case == "pickle":
        draft = bad(tmp_path, target, "d")
        from safetensors.torch import load_file

        torch.save(load_file(tmp_path / "d" / "model.safetensors"), tmp_path / "d" / "pytorch_model.bin")
        (tmp_path / "d" / "model.safetensors").unlink()
    elif case == "hidden":
        draft = bad(tmp_path, target, "d", hidden_size=64)
    elif case == "vocab":
        draft = bad(tmp_path, target, "d", vocab_size=1000)
    elif case == "fc":
        draft = bad(tmp_path, target, "d")
        cfg = json.loads((tmp_path / "d" / "config.json").read_text())
        cfg["dflash_config"]["target_layer_ids"] = [1, 5, 9]  # 3 taps, but fc was written for 2
        (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    elif case == "rope":
        draft = bad(tmp_path, target, "d", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif case == "layers":
        draft = bad(tmp_path, target, "d", target_layer_ids=[1, 40])
    elif case == "mask":
        draft = bad(tmp_path, target, "d", mask_token_id=60000)
    elif case == "block":
        args += ["--block-size", "32"]
    elif case == "long_prompt":
        args[2] = "word " * 9000
    elif case == "unknown_target":
        args += ["--target", "no-such-model"]
    elif case == "top_p":
        args += ["--temperature", "1", "--top-p", "0"]
    elif case == "max_tokens":
        args[4] = "0"
    r = run(*args, "--draft", draft)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert lines[-1].startswith("Error: ") and message in lines[-1], r.output
