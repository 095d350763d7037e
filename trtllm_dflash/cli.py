"""`trtdflash`: a thin click layer over functions a user can call from Python."""

from __future__ import annotations

import functools
import json
import os
import sys

import click

from .errors import DFlashError


def user_errors(fn):
    """Bad input gets one sentence and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(2)

    return wrapper


def _quiet_hf():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@click.group()
@click.version_option(package_name="trtllm-dflash")
def main():
    """Build, serve and run DFlash speculative decoding (block-diffusion drafts) for TensorRT-LLM and Triton."""
    _quiet_hf()


def sampling_options(fn):
    for opt in reversed([
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
        click.option("--seed", type=int, default=None),
    ]):
        fn = opt(fn)
    return fn


@main.command()
@click.option("--target", default="smollm2-135m", show_default=True, help="Preset name or local Hugging Face directory.")
@click.option("--draft", default=None, help="DFlash draft directory (z-lab format). Default: the target's packaged draft.")
@click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding (the baseline).")
@click.option("--prompt", required=True)
@click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the tokenizer's chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--block-size", type=int, default=None, help="Tokens per draft block (default: the draft's); 1 = autoregressive.")
@sampling_options
@click.option("--stop", "stop_strings", multiple=True, help="Stop string (repeatable).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@user_errors
def generate(target, draft, no_draft, prompt, chat, max_new_tokens, block_size, temperature, top_p, top_k, seed, stop_strings, dtype, as_json):
    """Generate text from a prompt with DFlash speculative decoding on the embedded PyTorch backend."""
    from .config import SamplingParams
    from .generate import GenerationStats
    from .runtime import DFlashEngine

    sampling = SamplingParams(temperature, top_p, top_k, seed)
    engine = DFlashEngine.load(target, draft, no_draft=no_draft, dtype=dtype, block_size=block_size,
                               progress=lambda m: click.echo(m, err=True))
    stats = GenerationStats()
    ids, text = [], []
    for new_ids, delta in engine.stream(engine.encode(prompt, chat), max_new_tokens=max_new_tokens, sampling=sampling,
                                        stop_strings=stop_strings, stats=stats):
        ids.extend(new_ids)
        text.append(delta)
        if not as_json:
            click.echo(delta, nl=False)
    if as_json:
        click.echo(json.dumps({"text": "".join(text), "token_ids": ids, "block_size": engine.block_size, **stats.to_dict()}))
    else:
        click.echo()
        click.echo(
            f"[{stats.num_tokens} tokens in {stats.wall_time:.2f}s, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.steps} steps, acceptance length {stats.acceptance_length:.2f}, block {engine.block_size}, {dtype}]",
            err=True,
        )


if __name__ == "__main__":
    main()
