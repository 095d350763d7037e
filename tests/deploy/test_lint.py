"""The build's compatibility lint (deploy/lint.py): each mismatch known to sink acceptance gets one sentence, refused
where certain and warned (and listed in DEPLOY.md) where likely; the Triton path renders prompts in the draft's
thinking mode, through the real chat-template machinery and a config.pbtxt that Triton's own parser reads."""

import dataclasses
import json

from click.testing import CliRunner
from google.protobuf import text_format
from transformers import AutoTokenizer
from tritonclient.grpc import model_config_pb2

from trtllm_dflash.cli import main
from trtllm_dflash.deploy.lint import lint
from trtllm_dflash.deploy.recipes import load_recipe
from trtllm_dflash.deploy.trtllm.options import llm_options
from trtllm_dflash.text import encode_prompt

NO_THINKING = {"enable_thinking": False}


def _findings(recipe, template_kwargs=NO_THINKING, **extra):
    return {
        (f.what, f.refuse): f.sentence
        for f in lint(recipe, llm_options(recipe, model="m", draft="d") | extra, template_kwargs)
    }


def test_prompts_rendered_in_another_thinking_mode_than_the_drafts_are_refused():
    qwen = load_recipe("qwen3-8b", "h100")  # a non-thinking draft (its card)
    assert "thinking on" in _findings(qwen, template_kwargs={})[("thinking", True)]
    found = _findings(qwen)
    assert ("thinking", True) not in found
    assert '"enable_thinking": false' in found[("thinking", False)]  # trtllm-serve's clients choose it themselves
    llama = load_recipe("llama-3.1-8b-instruct", "h100")  # a template without a thinking mode
    assert not [k for k in _findings(llama, template_kwargs={}) if k[0] == "thinking"]


def test_a_context_beyond_the_drafts_training_is_warned():
    qwen = load_recipe("qwen3-8b", "h100")
    assert "beyond the 3072 tokens" in _findings(qwen)[("context", False)]
    assert ("context", False) not in _findings(dataclasses.replace(qwen, max_seq_len=3072))


def test_a_target_quantized_unlike_the_drafts_quotes_our_table():
    assert "cut τ on math by 10 %" in _findings(load_recipe("qwen3-8b", "h100"))[("quant", False)]
    assert not [k for k in _findings(load_recipe("gpt-oss-120b", "h200")) if k[0] == "quant"]  # trained on MXFP4


def test_disaggregated_serving_is_refused():
    qwen = load_recipe("qwen3-8b", "h100")
    found = _findings(qwen, cache_transceiver_config={"backend": "UCX"})
    assert "PR #19352" in found[("disaggregated", True)]


def test_the_build_refuses_or_warns_in_one_sentence_and_deploy_md_lists_the_warnings(tmp_path):
    out = tmp_path / "qwen"
    r = CliRunner().invoke(main, ["build", "--target", "qwen3-8b", "--output", str(out)])
    assert r.exit_code == 0, r.output
    assert "Warning (context)" in r.output and "Traceback" not in r.output
    deploy = (out / "DEPLOY.md").read_text()
    assert "## Compatibility with the draft" in deploy and "**quant**" in deploy
    config = (out / "triton_repo/preprocessing/config.pbtxt").read_text()
    parsed = text_format.Parse(config, model_config_pb2.ModelConfig())  # Triton's own config schema and parser
    assert json.loads(parsed.parameters["chat_template_kwargs"].string_value) == NO_THINKING


def test_template_switches_reach_the_chat_template(target_dir):
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}{{ messages[0]['content'] }}"
    )
    plain = encode_prompt(tokenizer, "Hello", True, 1024)
    switched = encode_prompt(tokenizer, "Hello", True, 1024, NO_THINKING)
    assert tokenizer.decode(switched).startswith("/no_think") and not tokenizer.decode(plain).startswith("/no_think")


def test_a_recipe_without_training_facts_is_linted_only_for_what_the_options_show():
    qwen = dataclasses.replace(load_recipe("qwen3-8b", "h100"), draft_training=None)
    assert list(_findings(qwen, template_kwargs={})) == []
    assert list(_findings(qwen, cache_transceiver_config={"backend": "NIXL"})) == [("disaggregated", True)]
