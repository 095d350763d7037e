"""`trtdflash`: a thin click layer over functions a user can call from Python."""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import json
import os
import sys
from pathlib import Path

import click

from trtllm_dflash.clients.datasets import CONFIGS as SPEED_CONFIGS
from trtllm_dflash.config import DRAFT_LOSSES, DTYPE_CHOICES, ROUTER_MODES, SPECULATION, WEIGHTS
from trtllm_dflash.deploy.dynamo import DYNAMO_MODES
from trtllm_dflash.deploy.recipes import OPT_INS
from trtllm_dflash.deploy.trtllm.schema import DEFAULT_RELEASE as DEFAULT_TRTLLM_RELEASE
from trtllm_dflash.deploy.trtllm.schema import RELEASES as TRTLLM_RELEASES
from trtllm_dflash.engine.prefix_cache import DEFAULT_TOKENS as PREFIX_CACHE_TOKENS
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.threads import configure_threads

DTYPE_HELP = (
    "auto: bf16 where the CPU has bf16 arithmetic (AVX-512 BF16, AMX) or AVX2 alone (our kernel: bf16 weights, "
    "fp32 arithmetic), else fp32, whichever runs DFlash faster; fp32 output is token-identical to decoding "
    "without a draft"
)


def user_errors(fn):
    """Bad input gets one sentence and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(2)
        except OSError as e:  # the environment: writers work in temporary siblings they remove on failure (atomic.py)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                click.echo(
                    f"Error: the disk is full ({e.strerror} writing {e.filename or 'a file'}); outputs are replaced only when "
                    "complete, so free some space and run the command again.",
                    err=True,
                )
            elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                click.echo(
                    f"Error: {e.strerror}: {e.filename or 'a file'}; check the path and its permissions.", err=True
                )
            else:
                raise
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
    configure_threads()  # before any command imports torch (threads.py)


PROMPTS_FILE = click.Path(dir_okay=False, path_type=str)  # read by clients.bench.read_prompts
PROMPTS_FORMAT = 'one prompt per line, or JSON lines with a "prompt" field'


def options(*decorators):
    """One decorator from several, applied so that --help lists their options in the order given."""

    def apply(fn):
        for decorator in reversed(decorators):
            fn = decorator(fn)
        return fn

    return apply


# Options more than one command takes, each declared once here (tests/test_house.py holds the file to that).
target_option = click.option(
    "--target", default="smollm2-135m", show_default=True, help="Preset name or local Hugging Face directory."
)
model_options = options(
    target_option,
    click.option(
        "--draft", default=None, help="DFlash draft directory (z-lab format). Default: the target's packaged draft."
    ),
    click.option("--no-draft", is_flag=True, help="Plain autoregressive decoding (the baseline)."),
)
"""The embedded engine's target and draft: --target, --draft, --no-draft (generate, chat)."""
dtype_option = click.option(
    "--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True, help=DTYPE_HELP
)
output_dir_option = click.option(
    "--output", required=True, type=click.Path(path_type=str), help="Output directory (created atomically)."
)
"""A directory a command writes whole or not at all (build, convert)."""

speculation_option = click.option(
    "--speculation",
    type=click.Choice(SPECULATION),
    default="adaptive",
    show_default=True,
    help="adaptive: block length per request and step (down to 1, plain decoding) from measured costs and acceptance; "
    "planned: every request the draft length planned for the batch size, as TensorRT-LLM's draft_len_schedule; "
    "fixed: always the full block. Both measured modes draft nothing at batch sizes where drafting cannot pay.",
)
lookup_option = click.option(
    "--lookup/--no-lookup",
    default=True,
    show_default=True,
    help="Where a request's last tokens occurred before (prompt or answer), verify the tokens that followed them instead of "
    "the draft's guesses (prompt lookup, vLLM's ngram); output is the same either way.",
)

weights_option = click.option(
    "--weights",
    type=click.Choice(WEIGHTS),
    default="auto",
    show_default=True,
    help="auto: with --dtype bf16 (auto's choice where the CPU has AVX-512 BF16), a target shipped in 4 bits (the "
    "GGUF presets) is multiplied in its 4-bit form, under a third of the bytes a token streams, with the same output; "
    "bf16: always its bf16 weights.",
)
int8_draft_option = click.option(
    "--int8-draft/--no-int8-draft",
    default=True,
    show_default=True,
    help="bf16 on a CPU with AVX2 alone: keep the draft's weights as int8 (half the bytes a drafting step reads); output is the same either way.",
)


def prompt_input(fn):
    """The prompt as the argument, as `llm` and `ollama run` take it, or as --prompt; `-` reads it from stdin."""
    fn = click.option("--prompt", "prompt_option", default=None, help="The prompt, if not given as the argument.")(fn)
    return click.argument("prompt", required=False)(fn)


def the_prompt(prompt: str | None, prompt_option: str | None) -> str:
    if prompt is not None and prompt_option is not None:
        raise click.UsageError("Give the prompt once: as the argument or with --prompt, not both.")
    text = prompt if prompt is not None else prompt_option
    if text is None:
        raise click.UsageError(
            'Missing the prompt: give it as the argument ("-" reads it from stdin) or with --prompt.'
        )
    return sys.stdin.read() if text == "-" else text


load_options = options(
    click.option(
        "--prompts",
        "prompts_file",
        type=PROMPTS_FILE,
        default=None,
        help=f"{PROMPTS_FORMAT[0].upper()}{PROMPTS_FORMAT[1:]}. Default: held-out GSM8K questions "
        "alternating with everyday questions.",
    ),
    click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True),
    click.option(
        "--requests",
        type=click.IntRange(min=0),
        default=0,
        help="Requests per level (default: four per client, at least 8).",
    ),
    click.option(
        "--rounds",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Runs of every level on every server, the order turning; each figure is the median round's.",
    ),
)
"""What `bench` and `plan --calibrate` send under load (loadgen.compare)."""

sampling_options = options(
    click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
    click.option("--top-p", type=float, default=1.0, show_default=True),
    click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
    click.option("--seed", type=int, default=None),
)
"""Sampling, as SamplingParams takes it (generate, chat, client)."""


@main.command()
@model_options
@prompt_input
@click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the tokenizer's chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option(
    "--block-size", type=int, default=None, help="Tokens per draft block (default: the draft's); 1 = autoregressive."
)
@sampling_options
@click.option("--stop", "stop_strings", multiple=True, help="Stop string (repeatable).")
@dtype_option
@speculation_option
@lookup_option
@click.option(
    "--draft-vocab/--no-draft-vocab",
    default=True,
    show_default=True,
    help="Guess only among the draft's vocabulary (its draft_vocab.json) where it has one; output is the same either way.",
)
@click.option(
    "--draft-ngram/--no-draft-ngram",
    default=True,
    show_default=True,
    help="Re-weight greedy guesses with the draft's n-gram prior (its draft_ngram.npz) where it has one; output is the same either way.",
)
@int8_draft_option
@weights_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@user_errors
def generate(
    target,
    draft,
    no_draft,
    prompt,
    prompt_option,
    chat,
    max_new_tokens,
    block_size,
    temperature,
    top_p,
    top_k,
    seed,
    stop_strings,
    dtype,
    speculation,
    lookup,
    draft_vocab,
    draft_ngram,
    int8_draft,
    weights,
    as_json,
):
    """Generate text from a prompt with DFlash speculative decoding on the embedded PyTorch backend."""
    prompt = the_prompt(prompt, prompt_option)
    from trtllm_dflash.config import SamplingParams

    engine = _load_engine(
        target,
        draft,
        no_draft=no_draft,
        dtype=dtype,
        block_size=block_size,
        speculation=speculation,
        draft_vocab=draft_vocab,
        draft_ngram=draft_ngram,
        lookup=lookup,
        int8_draft=int8_draft,
        weights=weights,
    )
    _generate(
        engine, prompt, chat, max_new_tokens, SamplingParams(temperature, top_p, top_k, seed), stop_strings, as_json
    )


def _load_engine(target, draft, **engine_options):
    """The embedded engine generate and chat run on, its loading said on stderr."""
    from trtllm_dflash.engine.runtime import DFlashEngine

    return DFlashEngine.load(target, draft, progress=lambda m: click.echo(m, err=True), **engine_options)


def _generate(engine, prompt, chat, max_new_tokens, sampling, stop_strings, as_json):
    """Stream one answer to stdout (its speed to stderr), or print it as one JSON object."""
    from trtllm_dflash.engine.request import GenerationStats

    stats = GenerationStats()
    ids, text = [], []
    for new_ids, delta in engine.stream(
        engine.encode(prompt, chat),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_strings=stop_strings,
        stats=stats,
    ):
        ids.extend(new_ids)
        text.append(delta)
        if not as_json:
            click.echo(delta, nl=False)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "text": "".join(text),
                    "token_ids": ids,
                    "block_size": engine.block_size,
                    "dtype": engine.dtype,
                    "target_weights": engine.target_weights,
                    "draft_weights": engine.draft_weights,
                    **stats.to_dict(),
                }
            )
        )
    else:
        click.echo()
        click.echo(
            f"[{stats.num_tokens} tokens in {stats.wall_time:.2f}s, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.steps} steps, acceptance length {stats.acceptance_length:.2f}, block {engine.block_size}, {engine.dtype}"
            + (", target 4-bit" if engine.target_weights == "4-bit" else "")
            + (", draft int8]" if engine.draft_weights == "int8" else "]"),
            err=True,
        )


@main.command()
@model_options
@click.option("--system", default=None, help="A system message the conversation starts with.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True, help="Longest answer a turn may get.")
@sampling_options
@dtype_option
@speculation_option
@lookup_option
@int8_draft_option
@weights_option
@user_errors
def chat(
    target,
    draft,
    no_draft,
    system,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    dtype,
    speculation,
    lookup,
    int8_draft,
    weights,
):
    """Chat turn by turn on the embedded PyTorch backend, each answer streamed with its speed and acceptance.

    Reads one message a line from the terminal or from stdin; /reset starts a new conversation, /exit or Ctrl-D ends.
    Each turn's prompt is the whole conversation, and the earlier turns come from the prefix cache."""
    from trtllm_dflash.config import SamplingParams

    if max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    sampling = SamplingParams(temperature, top_p, top_k, seed)
    engine = _load_engine(
        target,
        draft,
        no_draft=no_draft,
        dtype=dtype,
        speculation=speculation,
        lookup=lookup,
        int8_draft=int8_draft,
        weights=weights,
    )
    if _chat(engine, target, system, max_new_tokens, sampling):
        sys.exit(2)


def _chat(engine, target, system, max_new_tokens, sampling) -> int:
    """The conversation, a message a line from stdin, each answer streamed; returns the turns refused."""
    from trtllm_dflash.clients.chat import Conversation
    from trtllm_dflash.engine.request import GenerationStats

    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):  # line editing and history for input(), where Python has them
            importlib.import_module("readline")
        click.echo(
            f"{target}, {engine.dtype}, "
            + ("no draft" if engine.draft is None else f"DFlash block {engine.block_size}")
            + ". One message a line; /reset starts over, /exit or Ctrl-D ends.",
            err=True,
        )
    failed = 0  # turns refused (a message that cannot fit): said at once, the chat goes on, the exit code tells
    with Conversation(engine, system) as conversation:
        while True:
            try:
                line = input("> " if interactive else "").strip()
            except (EOFError, KeyboardInterrupt):
                break
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                conversation.reset()
                click.echo("(a new conversation)", err=True)
                continue
            if not line:
                continue
            stats, dropped = GenerationStats(), conversation.dropped
            try:
                for delta in conversation.ask(line, max_new_tokens=max_new_tokens, sampling=sampling, stats=stats):
                    click.echo(delta, nl=False)
            except KeyboardInterrupt:  # Ctrl-C stops this answer (it stays out of the conversation), not the chat
                click.echo("\n(stopped; that turn is left out)", err=True)
                continue
            except DFlashError as e:
                click.echo(f"Error: {e}", err=True)
                failed += 1
                continue
            click.echo()
            note = (
                ""
                if conversation.dropped == dropped
                else f", the {conversation.dropped} oldest exchanges left out to fit the window"
            )
            click.echo(
                f"[{stats.num_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, acceptance length "
                f"{stats.acceptance_length:.2f}, first token {stats.time_to_first_token * 1000:.0f} ms, prompt "
                f"{stats.prompt_tokens} tokens of which {stats.cached_tokens} from the prefix cache{note}]",
                err=True,
            )
    return failed


@main.command()
@click.option(
    "--target",
    default="smollm2-135m",
    show_default=True,
    help="Local Hugging Face directory, an embedded preset (smollm2-135m, ...) or a GPU preset (gpt-oss-120b, qwen3-8b, ...).",
)
@click.option("--draft", default=None, help="DFlash draft directory (z-lab format). Default: the preset's draft.")
@click.option("--no-draft", is_flag=True, help="Build without a draft (plain autoregressive serving).")
@click.option(
    "--backend",
    default=None,
    help="torch: embedded PyTorch runtime; trtllm: TensorRT-LLM on NVIDIA GPUs. Default: trtllm for a GPU preset or "
    "any of --gpu/--recipe/--tp>1/--ep/--quant, else torch.",
)
@click.option(
    "--gpu", default=None, help="GPU of the deployment (h100, h200, b200, b300, ...). Default: the preset's (trtllm)."
)
@click.option("--recipe", default=None, help="latency or throughput, where the preset has both (trtllm).")
@click.option("--tp", type=int, default=None, help="Tensor-parallel size = GPUs (trtllm). Default: the recipe's.")
@click.option("--ep", type=int, default=None, help="MoE expert-parallel size (trtllm). Default: the recipe's.")
@click.option("--quant", default=None, help="none, fp8, nvfp4 or mxfp4 (trtllm). Default: the recipe's.")
@click.option(
    "--max-batch-size", type=int, default=None, help="Concurrent requests. Default: the recipe's (trtllm) or 8 (torch)."
)
@click.option(
    "--max-seq-len",
    type=int,
    default=None,
    help="Prompt + generated tokens per request. Default: the recipe's or the target's window.",
)
@click.option(
    "--block-size",
    type=int,
    default=None,
    help="Tokens per draft block (default: the draft's); the trtllm max_draft_len is this minus 1.",
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    help=DTYPE_HELP.replace("auto:", "auto, fp32 or bf16 (torch backend); auto:", 1),
)
@speculation_option
@lookup_option
@int8_draft_option
@weights_option
@click.option(
    "--prefix-cache-tokens",
    type=int,
    default=PREFIX_CACHE_TOKENS,
    show_default=True,
    help="Prompt tokens whose K/V the server keeps for later prompts that start the same way (a conversation "
    "resent with each turn, a shared system prompt); 0 = off (torch backend).",
)
@click.option("--force", is_flag=True, help="Write a TensorRT-LLM plan even if its memory plan does not fit the GPUs.")
@click.option(
    "--draft-engine",
    is_flag=True,
    help="Also write the ONNX drafter (block attention as one TensorRT plugin node) and, "
    "on a GPU host with TensorRT, build its engine.",
)
@click.option(
    "--trtllm-version",
    default=None,
    help=f"TensorRT-LLM release whose LLM-API fields and validators the options must meet ({', '.join(TRTLLM_RELEASES)}). "
    f"Default: {DEFAULT_TRTLLM_RELEASE}, the release DEPLOY.md's container carries.",
)
@click.option(
    "--opt-in",
    multiple=True,
    type=click.Choice(list(OPT_INS)),
    help="Take a recipe's choice that no upstream DFlash test covers (default: the tested one instead); repeatable.",
)
@click.option(
    "--acceptance-profile",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="TensorRT-LLM: plan the draft length by load from this measured speculation profile (what `trtdflash bench "
    "--dataset ... --output` writes beside its results) instead of a published or assumed τ.",
)
@click.option(
    "--replicas",
    type=click.IntRange(1, 1024),
    default=1,
    show_default=True,
    help="TensorRT-LLM: workers of --tp GPUs each behind Dynamo's KV router in dynamo/ (launch.sh, graph.yaml).",
)
@click.option(
    "--dynamo-mode",
    type=click.Choice(DYNAMO_MODES),
    default="agg",
    show_default=True,
    help="TensorRT-LLM: Dynamo's serving mode; disagg is refused with a draft (the decode side drafts without the prompt).",
)
@output_dir_option
@click.option("--dry-run", is_flag=True, help="Print the plan (steps, files, sizes, memory) and write nothing.")
@click.option(
    "--verify-on",
    type=PROMPTS_FILE,
    default=None,
    help=f"Before writing the output, serve the build and its draft-free twin with the real Triton server on these "
    f"prompts ({PROMPTS_FORMAT}), and write nothing where DFlash is slower at any level (torch backend); the verdict "
    "goes into manifest.json.",
)
@click.option(
    "--verify-concurrency",
    default=None,
    help="With --verify-on: clients per level, comma-separated (default: 1, 2, 4, ... up to --max-batch-size).",
)
@click.option(
    "--verify-rounds",
    type=click.IntRange(min=2),
    default=2,
    show_default=True,
    help="With --verify-on: rounds per level, half with each build's server started first; more rounds tell a "
    "smaller loss from the rounds' spread.",
)
@user_errors
def build(
    target,
    draft,
    no_draft,
    backend,
    gpu,
    recipe,
    tp,
    ep,
    quant,
    max_batch_size,
    max_seq_len,
    block_size,
    dtype,
    speculation,
    lookup,
    int8_draft,
    weights,
    prefix_cache_tokens,
    force,
    draft_engine,
    trtllm_version,
    opt_in,
    acceptance_profile,
    replicas,
    dynamo_mode,
    output,
    dry_run,
    verify_on,
    verify_concurrency,
    verify_rounds,
):
    """Build a Triton model repository (plus checkpoints or GPU launch files, manifest.json) from a target and a DFlash draft."""
    from pathlib import Path

    from trtllm_dflash.deploy import BuildOptions, run_build

    opts = BuildOptions(
        output=Path(output),
        target=target,
        draft=draft,
        no_draft=no_draft,
        backend=backend,
        gpu=gpu,
        recipe=recipe,
        tp=tp,
        ep=ep,
        quant=quant,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        block_size=block_size,
        dtype=dtype,
        speculation=speculation,
        lookup=lookup,
        int8_draft=int8_draft,
        weights=weights,
        prefix_cache_tokens=prefix_cache_tokens,
        force=force,
        draft_engine=draft_engine,
        trtllm_version=trtllm_version,
        opt_in=tuple(opt_in),
        acceptance_profile=acceptance_profile,
        replicas=replicas,
        dynamo_mode=dynamo_mode,
    )

    def progress(message: str) -> None:
        click.echo(message, err=True)

    if verify_on and not dry_run:
        from trtllm_dflash.clients.bench import build_verified

        levels = _levels(verify_concurrency, "--verify-concurrency")
        build_verified(opts, verify_on, levels, rounds=verify_rounds, progress=progress)
    else:
        run_build(opts, progress=progress, dry_run=dry_run)


@main.command("gpu-check")
@click.option(
    "--output",
    default="gpu-check",
    show_default=True,
    type=click.Path(path_type=str),
    help="Folder for the deployments, their server logs and gpu-check.json.",
)
@click.option(
    "--engine",
    default="trtllm",
    show_default=True,
    type=click.Choice(["trtllm", "embedded"]),
    help="trtllm: TensorRT-LLM on this host's GPU; embedded: our CPU engine behind the LLM API (no GPU).",
)
@click.option(
    "--target", default=None, help="A preset or a local checkpoint. Default: the preset that fits this host's GPU."
)
@click.option("--draft", default=None, help="DFlash draft directory or name. Default: the preset's.")
@click.option("--gpu", default=None, help="The recipe's GPU. Default: this host's.")
@click.option("--max-tokens", type=int, default=96, show_default=True, help="Tokens per checked answer.")
@user_errors
def gpu_check(output, engine, target, draft, gpu, max_tokens):
    """Build, launch (Triton and trtllm-serve) and check DFlash deployments on this host: one PASS/FAIL table."""
    from pathlib import Path

    from trtllm_dflash.deploy.gpu_check import CheckOptions, run_check, table

    rows = run_check(
        CheckOptions(Path(output), engine=engine, target=target, draft=draft, gpu=gpu, max_tokens=max_tokens),
        progress=lambda m: click.echo(m, err=True),
    )
    click.echo(table(rows))
    click.echo(f"Saved {Path(output) / 'gpu-check.json'}.")
    sys.exit(0 if all(r.passed for r in rows) else 1)


@main.command()
@click.argument("build_dir", type=click.Path(path_type=str))
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told otherwise)."
)
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="0 = pick a free port.")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option(
    "--openai-port",
    type=int,
    default=8003,
    show_default=True,
    help="OpenAI-compatible API (/v1/completions, /v1/chat/completions).",
)
@click.option("--no-openai", is_flag=True, help="Serve Triton's endpoints only.")
@click.option(
    "--dynamo",
    is_flag=True,
    help="Serve with NVIDIA Dynamo instead: its frontend (OpenAI API on --http-port, a KV router) and --workers "
    "replicas of the build, the machine's CPUs split between them (needs the `dynamo` extra).",
)
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True, help="With --dynamo: replicas.")
@click.option(
    "--router-mode",
    type=click.Choice(ROUTER_MODES),
    default="kv",
    show_default=True,
    help="With --dynamo: kv sends a prompt to the worker that holds its prefix (and with it the draft's context).",
)
@user_errors
def serve(build_dir, host, grpc_port, http_port, metrics_port, openai_port, no_openai, dynamo, workers, router_mode):
    """Serve a build with NVIDIA Triton Inference Server (plus an OpenAI-compatible API), or with --dynamo as a fleet
    of replicas behind NVIDIA Dynamo's KV router, until Ctrl-C / SIGTERM."""
    from pathlib import Path

    from trtllm_dflash.serving.serve import ServerConfig, TritonServer, serve_forever

    ctx = click.get_current_context()

    def given(*names: str) -> list[str]:
        source = click.core.ParameterSource.DEFAULT
        return [f"--{n.replace('_', '-')}" for n in names if ctx.get_parameter_source(n) != source]

    if dynamo and (triton := given("grpc_port", "metrics_port", "openai_port", "no_openai")):
        raise click.UsageError(
            f"{', '.join(triton)}: Triton's endpoints only; a --dynamo fleet serves the OpenAI API on --http-port."
        )
    if not dynamo and (fleet := given("workers", "router_mode")):
        raise click.UsageError(f"{', '.join(fleet)}: a Dynamo fleet's only; add --dynamo.")
    if dynamo:
        from trtllm_dflash.serving.fleet import Fleet, FleetConfig

        server = Fleet(FleetConfig(Path(build_dir), workers, host, http_port, router_mode))
    else:
        config = ServerConfig(
            Path(build_dir), host, grpc_port, http_port, metrics_port, None if no_openai else openai_port
        )
        server = TritonServer(config)
    try:
        code = serve_forever(server, progress=lambda m: click.echo(m, err=True))
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _stream_completion(url, prompt, max_tokens, stream, sampling, stop_words, as_json):
    from trtllm_dflash.clients.client import CompletionRequest, complete

    request = CompletionRequest(prompt, max_tokens, stream, sampling, tuple(stop_words))
    done = complete(url, request, on_text=None if as_json else lambda piece: click.echo(piece, nl=False))
    if as_json:
        click.echo(json.dumps(done.to_dict()))
    else:
        click.echo()
        click.echo(done.summary(), err=True)


@main.command()
@click.option("--url", default="127.0.0.1:8001", show_default=True, help="Triton gRPC endpoint.")
@prompt_input
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--stream/--no-stream", default=True, show_default=True, help="One response per step, or one at the end.")
@sampling_options
@click.option("--stop", "stop_words", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object: text, token count, acceptance length, TTFT, tokens/s.",
)
@user_errors
def client(url, prompt, prompt_option, max_tokens, stream, temperature, top_p, top_k, seed, stop_words, as_json):
    """Send one prompt to a running server over gRPC (tritonclient) and print the text as it arrives."""
    prompt = the_prompt(prompt, prompt_option)
    from trtllm_dflash.config import SamplingParams

    _stream_completion(
        url, prompt, max_tokens, stream, SamplingParams(temperature, top_p, top_k, seed), stop_words, as_json
    )


def _levels(text: str | None, flag: str) -> list[int] | None:
    """Concurrency levels from "1,4,16" (None stays None)."""
    if text is None:
        return None
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise click.BadParameter(
            f"give numbers of clients separated by commas, such as 1,4,16; got {text!r}.", param_hint=flag
        ) from None


def _speeds(text: str | None, flag: str) -> list[float]:
    """Positive speeds from "20,50" (None: none)."""
    if text is None:
        return []
    try:
        speeds = [float(c) for c in text.split(",")]
    except ValueError:
        speeds = []
    if not speeds or min(speeds) <= 0:
        raise click.BadParameter(
            f"give tokens/s per user separated by commas, such as 20,50; got {text!r}.", param_hint=flag
        )
    return speeds


@main.command()
@click.option(
    "--url",
    "urls",
    multiple=True,
    default=["127.0.0.1:8001"],
    show_default=True,
    help="Triton's gRPC endpoint (HOST:PORT), or an OpenAI-compatible server's (http://HOST:PORT: vLLM, SGLang, "
    "trtllm-serve, ours); repeat it to load several in turn (NAME=URL names one in the table).",
)
@click.option(
    "--concurrency", default="1,2,4,8", show_default=True, help="Closed-loop clients per level, comma-separated."
)
@load_options
@click.option(
    "--output", default=None, help="Write the results here as JSON, and the throughput-latency plot beside it (.png)."
)
@click.option(
    "--gate",
    is_flag=True,
    help="Acceptance gate: the first --url is a DFlash deployment, the second its --no-draft twin; exit 1 where DFlash "
    "is slower at any concurrency level (with --rounds 2 or more: slower beyond the rounds' spread, 95 % confidence).",
)
@click.option(
    "--deployment",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    help="With --gate: the DFlash build's folder, whose manifest.json records the verdict (speed-up and tau per "
    "level, the prompts' hash, date, machine).",
)
@click.option(
    "--interactivity",
    default=None,
    help="Tokens/s per user, comma-separated (such as 20,50): each server's total throughput at that per-user speed, "
    "read off its measured curve (never extrapolated), and the first server's ratio to the others.",
)
@click.option(
    "--dataset",
    type=click.Choice(["speed-bench", "builtin"]),
    default=None,
    help="Run categorised records as NVIDIA's SPEED-Bench harness does (one client slot per record for all its turns) "
    "and report its metrics per category: speed-bench reads --data, builtin is our own set of 11 categories.",
)
@click.option(
    "--data",
    type=click.Path(path_type=str),
    default=None,
    help="With --dataset speed-bench: the folder specdec_bench's prepare_data.py wrote (DATA/speed/<config>/"
    "test.parquet), a folder of parquet files, or one.",
)
@click.option(
    "--config",
    "speed_config",
    type=click.Choice(SPEED_CONFIGS),
    default="qualitative",
    show_default=True,
    help="With --dataset speed-bench: which SPEED-Bench config.",
)
@click.option("--category", default=None, help="With --dataset: only these categories, comma-separated.")
@click.option(
    "--num-requests",
    type=click.IntRange(min=1),
    default=None,
    help="With --dataset: this many records, round-robin over categories (specdec_bench's selection). Default: all.",
)
@click.option(
    "--tokenizer",
    type=click.Path(file_okay=False, path_type=str),
    default=None,
    help="With --dataset and a Triton gRPC --url: the build's tokenizer/ folder, to render multi-turn conversations.",
)
@click.option(
    "--conditions",
    is_flag=True,
    help="The --url's acceptance under each condition where upstream saw it collapse (long prompts, a warm prefix "
    "cache, temperature 0.7, thinking), one user at a time, against the short, cold, greedy baseline, on --dataset's "
    "records (builtin by default); with --gate, exit 1 on a collapse (τ under 70 % of the baseline's).",
)
@click.option(
    "--lengths",
    default=None,
    help="With --conditions: prompt lengths in tokens (about, without --tokenizer), comma-separated, up to the "
    "target's context. Default: 1024,4096.",
)
@user_errors
def bench(
    urls,
    concurrency,
    prompts_file,
    max_tokens,
    requests,
    rounds,
    output,
    gate,
    deployment,
    interactivity,
    dataset,
    data,
    speed_config,
    category,
    num_requests,
    tokenizer,
    conditions,
    lengths,
):
    """Load running servers with closed-loop streaming clients (each sends its next request when its last one ends):
    tokens/s, per-user speed, time to first token, inter-token latency and acceptance at each concurrency level; with
    --dataset, SPEED-Bench's records and metrics per category; with --conditions, acceptance where it may collapse."""
    if conditions:
        _bench_conditions(
            urls, dataset, data, speed_config, category, num_requests, tokenizer, lengths, max_tokens, output, gate
        )
        return
    if lengths is not None:
        raise click.UsageError("--lengths goes with --conditions.")
    if dataset is None and (data or category or num_requests or tokenizer):
        raise click.UsageError("--data, --category, --num-requests and --tokenizer go with --dataset.")
    if dataset is not None:
        _bench_dataset(
            urls,
            concurrency,
            max_tokens,
            output,
            interactivity,
            dataset,
            data,
            speed_config,
            category,
            num_requests,
            tokenizer,
            gate or deployment or prompts_file,
        )
        return
    _bench_load(urls, concurrency, prompts_file, max_tokens, requests, rounds, output, gate, deployment, interactivity)


def _bench_load(urls, concurrency, prompts_file, max_tokens, requests, rounds, output, gate, deployment, interactivity):
    """`bench` without --dataset or --conditions: the closed-loop levels, their table, and the gate where asked."""
    from trtllm_dflash.clients.bench import gate_failure, gate_lines, run_bench

    report = run_bench(
        urls,
        _levels(concurrency, "--concurrency"),
        prompts_file=prompts_file,
        max_tokens=max_tokens,
        requests=requests,
        rounds=rounds,
        output=output,
        gate=gate,
        deployment=deployment,
        interactivity=_speeds(interactivity, "--interactivity"),
        progress=lambda m: click.echo(m, err=True),
    )
    click.echo(report["table"])
    if report.get("interactivity"):
        click.echo("\n".join(["", "Throughput at a per-user speed (total tok/s):", *report["interactivity_lines"]]))
    if gate:
        click.echo("\n".join(["", "Gate, DFlash against its twin:", *gate_lines(report["gate"])]))
        if failure := gate_failure(report["gate"]):
            click.echo(
                f"Gate failed: {failure}; serve the twin at that load, or plan a shorter draft length.", err=True
            )
            sys.exit(1)
        click.echo("Gate passed: DFlash is not measurably slower than its draft-free twin at any level.")


def _records(dataset, data, config, category, n):
    """The records `bench --dataset` (or --conditions) runs."""
    from pathlib import Path

    from trtllm_dflash.clients.datasets import builtin_records, read_speed_bench, select

    if dataset == "speed-bench" and not data:
        raise click.UsageError("--dataset speed-bench needs --data: the folder specdec_bench's prepare_data.py wrote.")
    records = builtin_records() if dataset == "builtin" else read_speed_bench(Path(data), config)
    return select(records, n, [c for c in (category or "").split(",") if c])


def _bench_conditions(urls, dataset, data, config, category, n, tokenizer, lengths, max_tokens, output, gate):
    from trtllm_dflash.clients.bench import parse_urls
    from trtllm_dflash.clients.conditions import LENGTHS, bench_conditions, collapses, table

    ctx = click.get_current_context()
    moved = [
        f"--{name}"
        for name in ("concurrency", "interactivity", "deployment", "prompts_file", "requests", "rounds")
        if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT
    ]
    if moved:
        raise click.UsageError(f"--conditions runs one user at a time on its own records; leave out {moved[0]}.")
    if len(urls) != 1:
        raise click.UsageError("--conditions measures one server: give one --url, the DFlash deployment.")
    dataset = dataset or "builtin"
    report = bench_conditions(
        next(iter(parse_urls(urls).values())),
        _records(dataset, data, config, category, n),
        dataset=dataset if dataset == "builtin" else f"speed-bench {config}",
        lengths=_levels(lengths, "--lengths") or LENGTHS,
        max_tokens=max_tokens,
        tokenizer=tokenizer,
        output=output,
        progress=lambda m: click.echo(m, err=True),
    )
    click.echo(table(report))
    found = collapses(report)
    click.echo(
        "\n".join(["", *found])
        if found
        else f"\nNo collapse: every condition kept {report['collapse_below']:.0%} of the baseline's τ or more."
    )
    if gate and found:
        click.echo("Gate failed: acceptance collapses under a condition above.", err=True)
        sys.exit(1)


def _bench_dataset(
    urls, concurrency, max_tokens, output, interactivity, dataset, data, config, category, n, tokenizer, other
):
    from trtllm_dflash.clients.bench import category_table, run_dataset

    if other:
        raise click.UsageError("--dataset runs its own records: leave out --gate, --deployment and --prompts.")
    records = _records(dataset, data, config, category, n)
    report = run_dataset(
        urls,
        _levels(concurrency, "--concurrency"),
        records,
        dataset=dataset if dataset == "builtin" else f"speed-bench {config}",
        max_tokens=max_tokens,
        tokenizer=tokenizer,
        interactivity=_speeds(interactivity, "--interactivity"),
        output=output,
        progress=lambda m: click.echo(m, err=True),
    )
    click.echo(category_table(report))
    if report.get("interactivity"):
        from trtllm_dflash.clients.interactivity import readout_lines

        lines = readout_lines(report["interactivity"], list(report["levels"]))
        click.echo("\n".join(["Throughput at a per-user speed (Output TPS, per-request generation tok/s):", *lines]))


@main.command()
@click.argument("deployment", type=click.Path(file_okay=False, path_type=str))
@click.option(
    "--calibrate",
    "url",
    required=True,
    help="The running deployment: Triton's gRPC endpoint (HOST:PORT) or trtllm-serve's (http://HOST:PORT).",
)
@click.option(
    "--twin", default=None, help="Its --no-draft twin, running beside it: what a step costs without drafting."
)
@click.option(
    "--concurrency", default=None, help="Closed-loop clients per level. Default: 1, 2, 4, ... up to max_batch_size."
)
@load_options
@click.option("--dry-run", is_flag=True, help="Measure and print the new schedule; rewrite nothing.")
@user_errors
def plan(deployment, url, twin, concurrency, prompts_file, max_tokens, requests, rounds, dry_run):
    """Re-plan a TensorRT-LLM deployment's draft length by load (draft_len_schedule) from its own steps and acceptance,
    measured while it serves, and rewrite model.yaml and trtllm-serve.yaml (restart the servers to use it)."""
    from trtllm_dflash.deploy.calibrate import calibrate

    result = calibrate(
        deployment,
        url,
        twin,
        _levels(concurrency, "--concurrency"),
        prompts_file=prompts_file,
        max_tokens=max_tokens,
        requests=requests,
        rounds=rounds,
        dry_run=dry_run,
        progress=lambda m: click.echo(m, err=True),
    )
    click.echo(result.table())
    if not dry_run:
        click.echo(
            f"Rewrote draft_len_schedule in {deployment}'s model.yaml and trtllm-serve.yaml and recorded the calibration "
            "in its manifest.json; restart the servers to use it."
        )


@main.command()
@click.option(
    "--output",
    default=None,
    help="Build directory (default: <cache>/quickstart); rebuilt only when inputs change. "
    "The comparison build goes beside it, in OUTPUT-no-draft.",
)
@click.option("--draft", default=None, help="DFlash draft directory. Default: the packaged SmolLM2-135M draft.")
@click.option("--prompt", default=None, help="The prompt streamed first. Default: the comparison's first code prompt.")
@click.option("--max-tokens", type=int, default=96, show_default=True)
@dtype_option
@click.option(
    "--compare/--no-compare",
    default=True,
    show_default=True,
    help="Time DFlash against the same build without a draft on three chat, three math and three code prompts.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Runs of each prompt on each server (interleaved, the order alternating); the table pools them.",
)
@user_errors
def quickstart(output, draft, prompt, max_tokens, dtype, compare, rounds):
    """Build the embedded default (SmolLM2-135M + draft, torch backend), start Triton, stream one completion over gRPC,
    then show DFlash's speed-up over the same server without a draft."""
    from trtllm_dflash.clients.quickstart import comparison_table, run_quickstart

    result = run_quickstart(
        output,
        draft,
        prompt,
        max_tokens,
        dtype,
        compare,
        say=lambda m: click.echo(m, err=True),
        on_text=lambda piece: click.echo(piece, nl=False),
        rounds=rounds,
    )
    if result.rows:
        click.echo("\n" + comparison_table(result))


@main.command("train-draft")
@click.option(
    "--target", default="smollm2-135m", show_default=True, help="Preset name or local Hugging Face directory (frozen)."
)
@click.option("--output", required=True, help="Run directory (data, checkpoints); the draft lands in OUTPUT/draft.")
@click.option(
    "--data",
    "data",
    multiple=True,
    default=("gsm8k", "code"),
    show_default=True,
    help="Prompt source the target answers (repeatable): gsm8k (train split minus our 200 held-out), "
    "gsm8k-var (those questions with other numbers), code (library functions: signature + summary), "
    "docstring (library functions with doctest examples, HumanEval-shaped), "
    "magpie (chat questions SmolLM2 wrote itself, packaged with its greedy answers), "
    "instruct (writing, role-play, reasoning and explaining tasks: templates over the magpie topics); "
    "SOURCE:N takes the source's first N prompts.",
)
@click.option("--num-samples", type=int, default=None, help="At most this many prompts answered (default: all).")
@click.option("--data-minutes", type=float, default=None, help="Time budget of the data phase (default: none).")
@click.option("--gen-max-new-tokens", type=int, default=192, show_default=True)
@click.option("--gen-batch-size", type=int, default=64, show_default=True)
@click.option("--num-layers", type=int, default=3, show_default=True)
@click.option("--block-size", type=int, default=8, show_default=True)
@click.option("--steps", type=int, default=None, help="Optimiser steps (overrides --epochs).")
@click.option("--epochs", type=float, default=1.0, show_default=True)
@click.option("--lr", type=float, default=6e-4, show_default=True)
@click.option(
    "--loss",
    type=click.Choice(DRAFT_LOSSES),
    default="decay",
    show_default=True,
    help="Slot weights of the CE: a fixed exp(-(k-1)/gamma) decay, or D-PACE's dynamic weights from the draft's own "
    "confidence (a slot after an uncertain one counts less).",
)
@click.option(
    "--kd",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of the target's own distribution in each slot's label, 0 to 1 (knowledge distillation; the data "
    "phase then also keeps the target's last layer, 576 more bf16 values a token for SmolLM2).",
)
@click.option(
    "--short-blocks",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of training blocks cut to a random width below --block-size, 0 to 1, so the draft also guesses "
    "from a block of only the slots a short verify needs (3 instead of 8 for a 2-token block; the runtime "
    "still drafts whole blocks).",
)
@click.option("--max-seq-len", type=int, default=1024, show_default=True)
@click.option("--anchors-per-seq", type=int, default=64, show_default=True)
@click.option("--seqs-per-step", type=int, default=4, show_default=True)
@click.option("--eval-every", type=int, default=100, show_default=True, help="Steps between held-out evaluations.")
@click.option("--mask-token-id", type=int, default=None, help="Embedding row used as MASK (default: first unused row).")
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default="auto",
    show_default=True,
    help="Data generation and training. auto: each the faster on this CPU (the data in bf16 wherever our bf16 "
    "kernels run; training in bf16 autocast only on CPUs with bf16 arithmetic, else fp32).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--init-from",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Start from this draft's weights, e.g. to continue on more data. Same block size and target layers; "
    "with fewer layers than --num-layers it grows (new layers start as the identity).",
)
@click.option("--resume", is_flag=True, help="Continue the run in --output from its last checkpoint.")
@user_errors
def train_draft(
    target,
    output,
    data,
    num_samples,
    data_minutes,
    gen_max_new_tokens,
    gen_batch_size,
    num_layers,
    block_size,
    steps,
    epochs,
    lr,
    loss,
    kd,
    short_blocks,
    max_seq_len,
    anchors_per_seq,
    seqs_per_step,
    eval_every,
    mask_token_id,
    dtype,
    seed,
    init_from,
    resume,
):
    """Train a DFlash draft for a target on its own greedy answers (CPU is fine for small targets)."""
    from trtllm_dflash.train.trainer import train_draft as run

    run(
        target,
        output,
        data=data,
        num_samples=num_samples,
        data_minutes=data_minutes,
        gen_max_new_tokens=gen_max_new_tokens,
        gen_batch_size=gen_batch_size,
        mask_token_id=mask_token_id,
        resume=resume,
        command="trtdflash " + " ".join(sys.argv[1:]),
        log=lambda m: click.echo(m, err=True),
        num_layers=num_layers,
        block_size=block_size,
        steps=steps,
        epochs=epochs,
        lr=lr,
        loss=loss,
        kd=kd,
        short_blocks=short_blocks,
        max_seq_len=max_seq_len,
        anchors_per_seq=anchors_per_seq,
        seqs_per_step=seqs_per_step,
        eval_every=eval_every,
        dtype=dtype,
        seed=seed,
        init_from=init_from,
    )


@main.command("draft-vocab")
@target_option
@click.option(
    "--output",
    required=True,
    type=click.Path(path_type=str),
    help="The draft's directory (writes draft_vocab.json there) or a file path.",
)
@click.option(
    "--size", type=click.IntRange(min=1), default=16384, show_default=True, help="Tokens the draft may guess."
)
@click.option(
    "--data",
    "data",
    multiple=True,
    default=("gsm8k", "code", "magpie"),
    show_default=True,
    help="Prompt sources whose greedy answers are counted (repeatable; as train-draft's --data).",
)
@click.option(
    "--prompts", "per_source", type=click.IntRange(min=1), default=256, show_default=True, help="Prompts per source."
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True)
@click.option(
    "--ngram/--no-ngram",
    default=True,
    show_default=True,
    help="Also count the answers' n-grams into draft_ngram.npz beside it (the n-gram prior on greedy guesses).",
)
@user_errors
def draft_vocab(target, output, size, data, per_source, max_new_tokens, batch_size, dtype, ngram):
    """Write a draft vocabulary: the draft then guesses only among the SIZE tokens the target writes most (a smaller
    draft LM head; verification still sees every token, so output is unchanged), and the n-gram prior its greedy
    guesses are re-weighted with."""
    from trtllm_dflash.train.vocab import build_draft_vocab

    stats = build_draft_vocab(
        target,
        output,
        sources=tuple(data),
        size=size,
        per_source=per_source,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        dtype=dtype,
        ngram=ngram,
        progress=lambda m: click.echo(m, err=True),
    )
    click.echo(
        f"wrote {stats['path']}: {stats['size']} tokens, covering {stats['coverage']:.2%} of {stats['answer_tokens']} answer tokens"
    )
    if ngram:
        n = stats["ngram"]
        click.echo(f"wrote {n['path']}: {sum(n['entries'].values())} n-grams of {n['answer_tokens']} answer tokens")


@main.command()
@click.option(
    "--model", required=True, help="Preset name, local Hugging Face target directory, or DFlash draft directory."
)
@click.option(
    "--role",
    type=click.Choice(["target", "draft"]),
    default=None,
    help="Default: draft if the directory is a DFlashDraftModel, else target.",
)
@click.option("--quant", required=True, help="fp8, nvfp4, mxfp4 or w4a8_mxfp4_fp8.")
@click.option("--kv-cache-quant", default="none", show_default=True, help="none or fp8 (targets).")
@click.option("--calib-data", default="gsm8k", show_default=True, help="gsm8k, code, chat, or a .txt/.jsonl file.")
@click.option("--calib-samples", type=int, default=64, show_default=True)
@click.option(
    "--exclude", multiple=True, help="Keep Linear modules matching this pattern high precision (repeatable, fnmatch)."
)
@click.option(
    "--target", default=None, help="A draft's target for calibration (default: the one in its training.json)."
)
@output_dir_option
@click.option(
    "--offload/--no-offload",
    default=None,
    help="Target layer by layer from disk (same output, a fraction of the memory). Default: when the fp32 model would not fit in RAM.",
)
@user_errors
def convert(model, role, quant, kv_cache_quant, calib_data, calib_samples, exclude, target, output, offload):
    """Quantize a target or a DFlash draft with NVIDIA Model Optimizer into a TensorRT-LLM-loadable checkpoint."""
    _quiet_hf()
    from tqdm import tqdm

    from trtllm_dflash.convert import ConvertOptions, convert_checkpoint

    opts = ConvertOptions(
        model=model,
        role=role,
        quant=quant,
        kv_cache_quant=kv_cache_quant,
        calib_data=calib_data,
        calib_samples=calib_samples,
        exclude=exclude,
        target=target,
        output=output,
        offload=offload,
    )
    convert_checkpoint(
        opts, progress=lambda m: click.echo(m, err=True), track=lambda it, desc: tqdm(it, desc=desc, file=sys.stderr)
    )


@main.command("convert-draft")
@click.argument("source")
@click.argument("output", type=click.Path(path_type=str))
@click.option(
    "--target",
    default=None,
    help="z-lab -> speculators: the draft's target (preset or directory), whose embedding and LM head speculators "
    "stores beside the draft. Default: the draft's preset target.",
)
@click.option("--target-name", default=None, help="The verifier's name_or_path to record (default: the target's).")
@user_errors
def convert_draft(source, output, target, target_name):
    """Convert a DFlash draft between z-lab's format (TensorRT-LLM's) and vLLM's speculators format, either way: the
    direction is the one away from SOURCE's format. Tensors are copied unchanged."""
    from trtllm_dflash.models.speculators import is_speculators, to_speculators, to_zlab
    from trtllm_dflash.resolve import resolve_draft, resolve_target

    src = resolve_draft(source, target or "")
    if is_speculators(src):
        out = to_zlab(src, Path(output))
        click.echo(f"Wrote the z-lab DFlash draft {out} (from speculators format).")
        return
    if target is None:
        raise DFlashError("Converting to the speculators format stores the target's embedding: pass --target.")
    out = to_speculators(
        src, Path(output), resolve_target(target, lambda m: click.echo(m, err=True)), target_name or target
    )
    click.echo(f"Wrote the speculators DFlash draft {out} (verifier {target_name or target}).")


if __name__ == "__main__":
    main()
