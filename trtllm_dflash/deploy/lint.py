"""The build's compatibility lint: one sentence for each mismatch between a deployment and its draft that is known to
sink acceptance. Output stays lossless whatever the draft guesses, so none of these would show as an error at run
time: acceptance would just fall, silently. A certain mismatch refuses the build; a likely one warns, and DEPLOY.md
lists it. (The draft's shapes against the target's, target_layer_ids, mask id, hidden size and vocabulary, are
checked where the recipe is made: recipes._check_draft and validate.validate_pair.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trtllm_dflash.deploy.recipes import Recipe

# Our quantization-vs-acceptance table (docs/quantization.md, SmolLM2-135M, draft trained on the bf16 target): τ on
# math against the unquantized target's, per target format.
QUANT_TAU_ON_MATH = {"fp8": "10 %", "nvfp4": "14 %", "mxfp4": "26 %"}


@dataclass(frozen=True)
class Finding:
    refuse: bool
    what: str  # thinking | context | quant | disaggregated
    sentence: str


def lint(
    recipe: Recipe, options: Mapping[str, Any], template_kwargs: Mapping[str, Any], dynamo_mode: str = "agg"
) -> list[Finding]:
    """What the deployment (`options`: its LLM-API options; `template_kwargs`: what the Triton path renders the chat
    template with; `dynamo_mode`: how its Dynamo workers serve) does differently from what the recipe's draft was
    trained on."""
    if recipe.draft_config is None:
        return []
    found = []
    if dynamo_mode != "agg":
        found.append(
            Finding(
                True,
                "disaggregated",
                f"Dynamo's disaggregated mode ({dynamo_mode}) hands its decode workers a KV cache without the "
                "draft's context, so DFlash drafts without the prompt and acceptance drops silently (TensorRT-LLM "
                "#19352 only warns): build with --dynamo-mode agg, or without a draft (--no-draft).",
            )
        )
    transceiver = (options.get("cache_transceiver_config") or {}).get("backend")
    if transceiver:
        found.append(
            Finding(
                True,
                "disaggregated",
                f"Disaggregated serving (cache_transceiver_config backend {transceiver}) hands the generation server a "
                "KV cache without the draft's context, so the draft drafts without the prompt (TensorRT-LLM PR "
                "#19352): serve DFlash aggregated, or build the disaggregated deployment with --no-draft.",
            )
        )
    t = recipe.draft_training
    if t is None:
        return found
    if t.thinking is not None:
        triton = template_kwargs.get("enable_thinking", True)
        if triton != t.thinking:
            found.append(
                Finding(
                    True,
                    "thinking",
                    f"The Triton path renders prompts with thinking {'on' if triton else 'off'}, but the draft was "
                    f"trained with thinking {'on' if t.thinking else 'off'} ({t.source}); acceptance falls several-fold "
                    "(z-lab/dflash #60, #133).",
                )
            )
        found.append(
            Finding(
                False,
                "thinking",
                f"The draft was trained with thinking {'on' if t.thinking else 'off'}: trtllm-serve renders chat "
                f"requests with the template's default, so clients of `./launch.sh openai` should send "
                f'"chat_template_kwargs": {{"enable_thinking": {str(t.thinking).lower()}}} (the Triton path does).',
            )
        )
    if recipe.max_seq_len > t.max_context:
        found.append(
            Finding(
                False,
                "context",
                f"max_seq_len {recipe.max_seq_len} reaches beyond the {t.max_context} tokens the draft was trained on: "
                "expect acceptance to fall on long prompts and conversations (z-lab/dflash #66).",
            )
        )
    if recipe.quant != t.target_quant:
        found.append(
            Finding(
                False,
                "quant",
                f"The target runs {recipe.quant}, but the draft was trained on "
                f"{'an unquantized' if t.target_quant == 'none' else 'a ' + t.target_quant} target: in our "
                f"table (docs/quantization.md) a {recipe.quant} target cut τ on math by "
                f"{QUANT_TAU_ON_MATH.get(recipe.quant, 'an unmeasured share')}; retrain the draft on the quantized "
                "target's outputs where `trtdflash bench` on your prompts shows the loss.",
            )
        )
    return found
