"""The TensorRT-LLM backend of `trtdflash build`: a validated GPU deployment, written on any machine.

TensorRT-LLM runs DFlash in its PyTorch backend as a one-model speculative mode, loads Hugging Face (and ModelOpt
quantized) checkpoints directly and shards them for tensor/expert parallelism at load time (there is no
`trtllm-build` path for DFlash). So nothing is compiled here: the build picks a recipe (build_configs/), checks
the parallel layout and the draft against the target, plans memory per GPU, validates every LLM-API option
against the schema of a named TensorRT-LLM revision, and writes

    triton_repo/        preprocessing -> tensorrt_llm (LLM API; 1/model.yaml) -> postprocessing -> ensemble,
                        the same user-facing ensemble as the embedded backend
    trtllm-serve.yaml   the same options for `trtllm-serve` (OpenAI-compatible server)
    launch.sh           starts either on the GPU host after checking its GPUs
    DEPLOY.md           this build's GPUs, memory plan, commands and first checks
    python/trtllm_dflash/  the code the Triton models import: NVIDIA's container has no such package, and PyPI
                        has none either, so the deployment carries it (source only: no drafts, no data)
    checkpoints/, tokenizer/   only for local weights; a preset without them names the public ids, which the
                        GPU host fetches (nothing is downloaded here)
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from trtllm_dflash.config import max_draft_len
from trtllm_dflash.deploy import dynamo
from trtllm_dflash.deploy.dynamo import DYNAMO_IMAGE, DYNAMO_TRTLLM
from trtllm_dflash.deploy.memory import MemoryPlan, plan_recipe
from trtllm_dflash.deploy.recipes import (
    Parallelism,
    Recipe,
    conservative,
    is_gpu_preset,
    load_recipe,
    model_facts_from_hf_config,
    presets,
)
from trtllm_dflash.deploy.steps import PlannedFile, Step, stage_step, target_steps, template_step, text_step
from trtllm_dflash.deploy.trtllm.schema import DFLASH_FIXES, FIRST_DFLASH_RELEASE, release
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import check_draft
from trtllm_dflash.models.speculators import resolve_any_draft
from trtllm_dflash.resolve import sha256_file
from trtllm_dflash.serving.repository import RepoParams

ENGINE_MODEL = "tensorrt_llm"
CARRIED = "python"  # the folder beside triton_repo/ whose trtllm_dflash the Triton models put first on sys.path
CARRIED_SUFFIXES = (".py", ".json", ".cpp", ".h")  # code, the LLM-API schema, the CPU kernels' sources
CARRIED_SKIP = ("drafts", "data")  # weights and prompt sets: a deployment stages its own draft into checkpoints/
# What the carried code imports besides the standard library; NVIDIA's TensorRT-LLM containers have each of them
# (TensorRT-LLM's requirements.txt, transformers' dependencies). The CI test serves a deployment with these alone.
CONTAINER_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pyyaml", "tqdm")
MODEL_YAML = f"triton_repo/{ENGINE_MODEL}/1/model.yaml"
SERVE_YAML = "trtllm-serve.yaml"
# `trtdflash convert` format for a --quant of local dense weights: TensorRT-LLM's QuantAlgo has no plain MXFP4 for dense
# linears (W4A8_MXFP4_FP8, W4A8_MXFP4_MXFP8, W4A16_MXFP4; tensorrt_llm/quantization/mode.py), so MXFP4 weights run with FP8
# activations (W4A8_MXFP4_FP8).
CONVERT_FORMAT = {"mxfp4": "w4a8_mxfp4_fp8"}
LOCAL_GPU = "h100"  # --gpu default for a local target (no recipe says otherwise)
LOCAL_LIMITS = {"max_batch_size": 64, "max_num_tokens": 8192}  # max_seq_len: the target's window, as for torch


@dataclass
class Deployment:
    """The recipe with the CLI's overrides, where the weights come from, and the memory plan."""

    recipe: Recipe
    memory: MemoryPlan
    target_ref: str  # model.yaml value: a path relative to the model.yaml folder, or a hub id
    draft_ref: str | None
    serve_target: str  # trtllm-serve's model argument (relative to the build folder, or a hub id)
    serve_draft: str | None
    tokenizer_ref: str  # Triton models' tokenizer_dir: relative to a model folder, or a hub id
    local: bool  # weights staged into checkpoints/
    quantize: str | None = None  # local weights quantized by the build (a `trtdflash convert` format)
    draft_files: tuple[Path, ...] = ()  # a local draft for a preset target, staged into checkpoints/draft

    trtllm_version: str | None = None  # the TensorRT-LLM release the options are validated against (None: the default)
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)  # opt-in name -> the tested choice taken instead
    replicas: int = 1  # Dynamo workers (dynamo/), each on the recipe's GPUs
    dynamo_mode: str = "agg"  # the Dynamo serving mode asked for (deploy/lint.py refuses disagg with a draft)

    @property
    def release(self):
        return release(self.trtllm_version)

    @property
    def template_kwargs(self) -> dict:
        """What the Triton path renders the chat template with: the draft's trained thinking mode, where it has one."""
        t = self.recipe.draft_training
        has_mode = self.draft_ref is not None and t is not None and t.thinking is not None
        return {"enable_thinking": t.thinking} if has_mode else {}

    @property
    def findings(self):
        """The compatibility lint's findings (deploy/lint.py) for this deployment."""
        from trtllm_dflash.deploy.lint import lint

        return lint(self.recipe, self.options(), self.template_kwargs, self.dynamo_mode)

    @property
    def schedule(self):
        """The planned draft lengths by load that model.yaml and trtllm-serve.yaml carry (None: not planned)."""
        from trtllm_dflash.deploy.trtllm.options import planned_schedule

        return planned_schedule(self.recipe)

    def options(self) -> dict:
        from trtllm_dflash.deploy.trtllm.options import llm_options

        return llm_options(
            self.recipe,
            model=self.target_ref,
            draft=self.draft_ref,
            where=MODEL_YAML,
            trtllm_version=self.trtllm_version,
        )

    def serve_options(self) -> dict:
        from trtllm_dflash.deploy.trtllm.options import serve_options

        return serve_options(self.recipe, draft=self.serve_draft, where=SERVE_YAML, trtllm_version=self.trtllm_version)

    def dynamo_options(self) -> dict:
        """dynamo/engine.yaml: trtllm-serve's options, validated against the release Dynamo's image carries."""
        from trtllm_dflash.deploy.trtllm.options import serve_options

        return serve_options(
            self.recipe, draft=self.serve_draft, where=dynamo.ENGINE_YAML, trtllm_version=DYNAMO_TRTLLM
        )


def _check_weights(recipe: Recipe) -> None:
    """TensorRT-LLM reads quantization from the checkpoint (a ModelOpt export) and does not quantize at load time."""
    shipped = recipe.model_facts.shipped_quant
    if recipe.checkpoint is None and recipe.quant not in ("none", shipped):
        raise DFlashError(
            f"{recipe.id}: --quant {recipe.quant} needs a {recipe.quant} checkpoint, but {recipe.hf_id} is {shipped if shipped != 'none' else 'unquantized'} "
            f"and TensorRT-LLM does not quantize at load time; build from its weights with --target DIR --quant {recipe.quant} "
            f"(the build quantizes local weights with ModelOpt), or choose --quant {shipped}."
        )


def _overrides(opts, recipe: Recipe, block_size: int | None) -> Recipe:
    draft_len = None if block_size is None else max_draft_len(block_size)
    if opts.quant is not None and opts.quant != recipe.quant:
        recipe = dataclasses.replace(recipe, checkpoint=None)  # the recipe's quantized checkpoint is for its own quant
    return recipe.with_overrides(
        tp=opts.tp,
        ep=opts.ep,
        quant=opts.quant,
        max_batch_size=opts.max_batch_size,
        max_seq_len=opts.max_seq_len,
        max_draft_len=draft_len,
    )


def _local_recipe(opts, sources) -> Recipe:
    """A recipe for a local checkpoint: its own facts, the CLI's GPU and layout, defaults for the limits."""
    config = json.loads((sources.target_dir / "config.json").read_text())
    fp32 = config.get("torch_dtype", config.get("dtype")) == "float32"
    facts = model_facts_from_hf_config(
        {**config, "torch_dtype": "bfloat16"} if fp32 else config
    )  # fp32 is served in bf16
    draft = check_draft(sources.draft_dir) if sources.draft_dir else None
    gpu = (opts.gpu or LOCAL_GPU).lower()
    tp = opts.tp or 1
    batch = opts.max_batch_size or LOCAL_LIMITS["max_batch_size"]
    return Recipe(
        id=f"{sources.target_dir.name}/{gpu}",
        model=sources.target_dir.name,
        hf_id=str(sources.target_dir),
        model_facts=facts,
        draft_hf_id=None,
        draft_config=draft,
        gpu=gpu,
        num_gpus=tp,
        parallel=Parallelism(tp=tp, ep=opts.ep or 1),
        quant=opts.quant or facts.shipped_quant,
        kv_cache_dtype="auto",
        max_batch_size=batch,
        max_seq_len=sources.max_seq_len,
        max_num_tokens=LOCAL_LIMITS["max_num_tokens"],
        max_draft_len=max_draft_len(sources.block_size) if draft else 0,
        cuda_graph_batch_sizes=tuple(2**i for i in range(batch.bit_length()) if 2**i <= batch),
        llm_args={"dtype": "bfloat16"} if fp32 else {},
    )


def read_profile(path: str) -> tuple[tuple[float, ...], str]:
    """`--acceptance-profile FILE` (clients/specbench.profile): its conditional acceptance per draft position, and a
    source naming the file and what it was measured on."""
    from trtllm_dflash.engine.plan import Acceptance

    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"--acceptance-profile {path} is not a readable JSON file ({e}).") from None
    c = data.get("conditions") or {} if isinstance(data, dict) else {}
    measured = ", ".join(str(c[k]) for k in ("dataset", "date", "machine") if c.get(k))
    acceptance = Acceptance.from_profile(data, f"profile {p.name}" + (f" ({measured})" if measured else ""))
    return acceptance.conditional, acceptance.source


def draft_profile(draft_dir: Path | None) -> str | None:
    """The speculation profile a local draft carries (specbench.PROFILE beside its weights; the packaged draft's is
    measured on the built-in set), which plans its draft lengths where no --acceptance-profile is given."""
    from trtllm_dflash.clients.specbench import PROFILE

    path = draft_dir / PROFILE if draft_dir is not None else None
    return str(path) if path is not None and path.is_file() else None


def plan_deployment(opts, progress: Callable[[str], None], resolve_sources) -> tuple[Deployment, object | None]:
    """The deployment and, for local weights, the resolved sources (files to stage)."""
    if is_gpu_preset(opts.target):
        recipe = load_recipe(opts.target, opts.gpu, opts.recipe)
        if opts.no_draft:
            recipe = dataclasses.replace(recipe, draft_hf_id=None, draft_config=None, max_draft_len=0)
        sources = None
        draft_dir = resolve_any_draft(opts.draft, opts.target) if opts.draft else None
        if draft_dir is not None:  # a local draft for a preset target: checked against the preset's target facts
            draft = check_draft(draft_dir)
            recipe = dataclasses.replace(  # the preset's published acceptance is its own draft's, not this one's
                recipe,
                draft_config=draft,
                max_draft_len=min(recipe.max_draft_len, max_draft_len(draft.block_size)),
                draft_acceptance=None,
            )
        recipe = _overrides(opts, recipe, opts.block_size)
        _check_weights(recipe)
        recipe, tested = conservative(recipe, opts.opt_in)
        draft_files = (draft_dir / "config.json", *sorted(draft_dir.glob("*.safetensors"))) if draft_dir else ()
        hub_draft = recipe.draft_hf_id if recipe.draft_config is not None and not draft_dir else None
        dep = Deployment(
            recipe,
            plan_recipe(recipe),
            recipe.weights,
            "../../../checkpoints/draft" if draft_dir else hub_draft,
            recipe.weights,
            "checkpoints/draft" if draft_dir else hub_draft,
            recipe.weights,
            local=False,
            draft_files=draft_files,
            trtllm_version=opts.trtllm_version,
            replaced=tested,
            replicas=opts.replicas,
            dynamo_mode=opts.dynamo_mode,
        )
        progress(
            f"Recipe {recipe.id}: the target's weights are not local; the GPU host fetches {recipe.weights}"
            + (f" and {hub_draft}" if hub_draft else "")
            + "."
        )
    else:
        if opts.recipe:
            raise DFlashError(
                f"--recipe applies to GPU presets ({', '.join(presets())}); a local target takes --gpu, --tp and --ep."
            )
        sources = resolve_sources(opts, progress)
        recipe, tested = conservative(_local_recipe(opts, sources), opts.opt_in)
        draft_dir = sources.draft_dir
        has_draft = draft_dir is not None
        shipped = recipe.model_facts.shipped_quant
        quantize = None if recipe.quant in ("none", shipped) else CONVERT_FORMAT.get(recipe.quant, recipe.quant)
        dep = Deployment(
            recipe,
            plan_recipe(recipe),
            "../../../checkpoints/target",
            "../../../checkpoints/draft" if has_draft else None,
            "checkpoints/target",
            "checkpoints/draft" if has_draft else None,
            "../../tokenizer",
            local=True,
            quantize=quantize,
            trtllm_version=opts.trtllm_version,
            replaced=tested,
            replicas=opts.replicas,
            dynamo_mode=opts.dynamo_mode,
        )
    profile = opts.acceptance_profile or draft_profile(draft_dir)
    if profile and dep.recipe.draft_config is not None:
        dep.recipe = dataclasses.replace(dep.recipe, draft_profile=read_profile(profile))
    if dep.replaced:
        progress(
            f"Untested upstream with DFlash, so not taken: {'; '.join(dep.replaced.values())} (--opt-in to take them)."
        )
    findings = dep.findings
    refused = [f.sentence for f in findings if f.refuse]
    if refused:
        raise DFlashError(" ".join(refused))
    for f in findings:
        progress(f"Warning ({f.what}): {f.sentence}")
    if not dep.memory.fits and not opts.force:
        m = dep.memory
        raise DFlashError(
            f"The plan does not fit: {m.num_gpus} x {m.gpu} leaves {m.kv_pool_bytes / 1e9:.1f} GB per GPU for a KV cache that needs "
            f"{m.kv_cache_bytes / 1e9:.1f} GB at --max-batch-size {m.max_batch_size}; use --max-batch-size "
            f"{m.max_batch_size_that_fits} or less, a shorter --max-seq-len, more GPUs, or --force."
        )
    dep.options()  # validate every options file now, before anything is written
    dep.serve_options()
    dep.dynamo_options()
    return dep, sources


def options_yaml(data: dict) -> str:
    """model.yaml's and trtllm-serve.yaml's keys as written (calibrate.py rewrites them the same way)."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def model_yaml(dep: Deployment) -> str:
    return (
        "# tensorrt_llm.LLM(**these keys) in the Triton `tensorrt_llm` model; written and validated by trtdflash build.\n"
        "# Relative paths are relative to this folder.\n" + options_yaml(dep.options())
    )


def serve_yaml(dep: Deployment) -> str:
    return (
        f"# trtllm-serve {dep.serve_target} --config {SERVE_YAML}   (run from this folder; written by trtdflash build)\n"
        + options_yaml(dep.serve_options())
    )


def launch_sh(dep: Deployment) -> str:
    r, rel = dep.recipe, dep.release
    env = r.llm_args.get("env_overrides") or {}
    exports = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
    return f"""#!/usr/bin/env bash
# Start this DFlash deployment ({r.id}) on a GPU host with {r.num_gpus} x {r.gpu.upper()}. Written by trtdflash build.
#   ./launch.sh           Triton Inference Server: gRPC :8001, HTTP :8000, metrics :8002 (model "ensemble")
#   ./launch.sh openai    trtllm-serve: OpenAI-compatible API on :8000
# Validated against {rel.label}: run it inside {rel.container}, with this folder and nothing else
# (the Triton models import the copy of trtllm_dflash in {CARRIED}/). Ports: HTTP_PORT, GRPC_PORT, METRICS_PORT.
# TRTDFLASH_LLM_ENGINE=embedded runs our CPU engine behind the LLM API instead of TensorRT-LLM (tests, no GPU).
set -euo pipefail
cd "$(dirname "$0")"
http=${{HTTP_PORT:-8000}} grpc=${{GRPC_PORT:-8001}} metrics=${{METRICS_PORT:-8002}}
if [ "${{TRTDFLASH_LLM_ENGINE:-}}" != embedded ]; then
  need={r.num_gpus}
  have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if [ "$have" -lt "$need" ]; then
    echo "This deployment needs $need GPUs ({r.gpu.upper()}); nvidia-smi sees $have." >&2
    exit 2
  fi
  python3 - <<'CHECK' || exit 2
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    found = version("tensorrt_llm")
except PackageNotFoundError:
    sys.exit("TensorRT-LLM is not installed here; run this deployment inside {rel.container}.")
from packaging.version import Version
if Version(found) < Version("{FIRST_DFLASH_RELEASE}"):
    sys.exit(f"TensorRT-LLM {{found}} has no DFlash (it came in {FIRST_DFLASH_RELEASE}); run this inside {rel.container}.")
for fixed_in, pr, without in {list(DFLASH_FIXES)!r}:
    if Version(found) < Version(fixed_in):
        print(f"Warning: TensorRT-LLM {{found}} lacks {{pr}} (in {{fixed_in}}): {{without}}.", file=sys.stderr)
if found != "{rel.name}":
    print(f"Note: TensorRT-LLM {{found}} here; the options were validated against {rel.name}.", file=sys.stderr)
CHECK
fi
{exports}case "${{1:-triton}}" in
  triton) command -v tritonserver > /dev/null || {{ echo "tritonserver is not on PATH (no published image has it beside a TensorRT-LLM with DFlash): use ./launch.sh openai, dynamo/launch.sh inside {DYNAMO_IMAGE}, or build an image with both (DEPLOY.md)." >&2; exit 2; }}
          exec tritonserver --model-repository="$PWD/triton_repo" --http-port="$http" --grpc-port="$grpc" \\
            --metrics-port="$metrics" --disable-auto-complete-config ;;
  openai) exec trtllm-serve {shlex.quote(dep.serve_target)} --config {SERVE_YAML} --host 0.0.0.0 --port "$http" ;;
  *) echo "usage: $0 [triton|openai]" >&2; exit 2 ;;
esac
"""


def _findings_md(dep: Deployment) -> str:
    findings = dep.findings
    if not findings:
        return ""
    return "## Compatibility with the draft\n\n" + "".join(f"- **{f.what}**: {f.sentence}\n" for f in findings) + "\n"


def _schedule_md(dep: Deployment) -> str:
    plan = dep.schedule
    if plan is None:
        return ""
    return f"""## Draft length by load (planned)

`speculative_config.draft_len_schedule` in model.yaml and trtllm-serve.yaml is {json.dumps(plan.schedule())}: per batch
size, the draft length with the most expected committed tokens per second, from the draft's acceptance and a roofline
of this GPU: an estimate, not a measurement. With this deployment and its `--no-draft` twin running, `trtdflash plan .
--calibrate HOST:PORT --twin HOST:PORT` measures their steps and acceptance, re-plans, and rewrites both files.

{plan.table()}

"""


def deploy_md(dep: Deployment) -> str:
    r, m, rel = dep.recipe, dep.memory, dep.release
    p = r.parallel
    weights = (
        "staged in `checkpoints/` (hard links or copies of the local weights)"
        if dep.local
        else f"not in this folder: the GPU host fetches `{r.weights}`"
        + (f" and `{dep.draft_ref}`" if dep.draft_ref else "")
        + " from Hugging Face on first start (set `HF_TOKEN` for gated models)"
    )
    draft = (
        f"DFlash draft `{dep.draft_ref}`, up to "
        f"{dep.schedule.max_draft_len if dep.schedule else r.max_draft_len} draft tokens per step "
        f"(block {r.draft_config.block_size})"
        if r.draft_config
        else "no draft (plain autoregressive decoding)"
    )
    tested = (
        f"**Tested choices.** Upstream has no DFlash test of these recipe choices, so this build took the tested "
        f"one instead: {'; '.join(dep.replaced.values())}. `trtdflash build --opt-in NAME` ({', '.join(dep.replaced)}) "
        f"takes the recipe's own; `trtdflash gpu-check` tries each.\n\n"
        if dep.replaced
        else ""
    )
    return f"""# Deploying `{r.id}`

Generated by `trtdflash build`. The options were validated against {rel.label}'s LLM-API fields and validators
(`--trtllm-version` chooses another release). The deployment carries the code its Triton models import
(`{CARRIED}/trtllm_dflash/`): nothing is installed on the GPU host.

- **Target**: `{r.weights}`, quantization `{r.quant}`, KV cache `{r.kv_cache_dtype}`; {draft}.
- **GPUs**: {r.num_gpus} x {r.gpu.upper()}; tensor parallel {p.tp}, pipeline parallel {p.pp}, expert parallel {p.ep},
  attention data parallel {"on" if p.attention_dp else "off"}.
- **Limits**: max_batch_size {r.max_batch_size}, max_seq_len {r.max_seq_len}, max_num_tokens {r.max_num_tokens}.
- **Weights**: {weights}.

{tested}{_findings_md(dep)}{_schedule_md(dep)}## Memory plan (per GPU, computed without a GPU)

```
{m.describe()}
```

## Start

```bash
docker run --rm -it --gpus all --net host --shm-size=2g --ulimit memlock=-1 \\
  -v "$PWD":/deploy -v ~/.cache/huggingface:/root/.cache/huggingface \\
  {rel.container} bash
cd /deploy && ./launch.sh openai         # trtllm-serve, OpenAI-compatible on :8000
./launch.sh                              # or Triton: gRPC :8001, HTTP :8000 (model "ensemble")
```

`launch.sh` refuses a TensorRT-LLM older than {FIRST_DFLASH_RELEASE} (no DFlash), names each DFlash fix the running
release lacks, and says so when the container's release is not {rel.name}.

**An image for the Triton path.** `./launch.sh` (Triton) needs `tritonserver` beside a TensorRT-LLM with DFlash, and no
published image has both: NVIDIA's `tritonserver:<yy.mm>-trtllm-python-py3` images up to 26.07 carry TensorRT-LLM 1.2.1
(no DFlash), and `{rel.container}` is built without `/opt/tritonserver`. The documented route is TensorRT-LLM's own
Triton image, built from a checkout at the release tag (it compiles TensorRT-LLM: about 63 GB of disk, hours):

```bash
git clone --branch v{rel.name} https://github.com/NVIDIA/TensorRT-LLM && cd TensorRT-LLM
git lfs pull && make -C docker tritonrelease_build    # then run ./launch.sh inside that image
```

Or serve without Triton: `./launch.sh openai` here, or Dynamo below, whose published image serves DFlash as it is.

## Serve with NVIDIA Dynamo (replicas behind a KV router)

`dynamo/` holds the same deployment for Dynamo {dynamo.DYNAMO_RELEASE}: `engine.yaml` (these options, validated against
TensorRT-LLM {DYNAMO_TRTLLM}, the release its image carries), `launch.sh` and `graph.yaml`, {dep.replicas} worker(s) of
{r.num_gpus} GPU(s) each (`trtdflash build --replicas N`). Aggregated only: a disaggregated decode worker drafts without
the prompt's hidden states.

```bash
docker run --rm -it --gpus all --net host --shm-size=2g -v "$PWD":/deploy {DYNAMO_IMAGE} \\
  bash -c 'cd /deploy && ./dynamo/launch.sh'        # one host: frontend (OpenAI on :8000, KV router) + workers
kubectl create secret generic {dynamo.HF_SECRET} --from-literal=HF_TOKEN=...   # Kubernetes, with Dynamo's operator
kubectl apply -f dynamo/graph.yaml                  # a DynamoGraphDeployment and the ConfigMap holding engine.yaml
```

{"The weights are in this folder: on Kubernetes, copy it into the volume claimed by `" + dynamo.graph_name(r.model) + "-deployment` (mounted at " + dynamo.DEPLOYMENT_MOUNT + ")." if dep.local else "The workers fetch the weights from Hugging Face on first start."}
{"KV block reuse is off in this recipe (upstream's DFlash tests turn it off; `--opt-in block-reuse` takes it), so TensorRT-LLM publishes no KV events and the router balances load without prefix matches." if not r.llm_args.get("kv_cache_config", {}).get("enable_block_reuse", True) or "block-reuse" in dep.replaced else "The workers publish their KV cache blocks, so the router sends a conversation's next turn to the replica that holds its prefix."}
{"" if r.draft_config is None else "Both files set DYN_AIS_NEXTN and DYN_AIS_NEXTN_ACCEPT_RATES, the draft's acceptance per position as Dynamo's AISimulate estimator reads it (the router's `--router-prefill-load-model ais`, the mocker, the profiler's simulations) in place of its default [0.85, 0.3, 0, 0, 0]; `trtdflash build --acceptance-profile` fills them from a measured profile (`trtdflash bench --dataset`)."}

## Check first

1. `nvidia-smi` shows {r.num_gpus} GPUs with the memory above free.
2. The server log shows `tensorrt_llm: starting tensorrt_llm.llmapi.llm.LLM` and the model `ensemble` READY.
3. `trtdflash client --url HOST:8001 --prompt "Hello" --json` answers, with `acceptance_length` above 1.
4. `trtdflash gpu-check` (from a clone of trtllm-dflash, `pip install --no-deps -e .` in the same container) builds
   the preset that fits one GPU with and without the draft, and each opt-in, launches each through both paths and
   prints one PASS/FAIL table (greedy identity, acceptance, exact counts, finish reasons, a cancelled stream).
5. `trtdflash bench --url HOST:8001 --concurrency 1,4,16,64` loads it with closed-loop streaming clients: tokens/s,
   time to first token, inter-token latency and acceptance per level (`--url dflash=HOST:8001 --url plain=HOST:9001`
   beside a build made with `--no-draft`, or `--url vllm=http://HOST:8000` beside a peer's OpenAI API; `--output
   results.json` adds a plot).
"""


def carried_files() -> list[Path]:
    """This package's source files, relative to the package folder: what `python/trtllm_dflash/` holds."""
    root = Path(__file__).resolve().parents[1]
    return sorted(
        rel
        for rel in (p.relative_to(root) for p in root.rglob("*") if p.is_file())
        if rel.suffix in CARRIED_SUFFIXES and rel.parts[0] not in CARRIED_SKIP and "__pycache__" not in rel.parts
    )


def carried_package_step(hashes: dict[str, str]):
    """Copy trtllm_dflash's source into the deployment, so that `./launch.sh` starts in the stock container."""
    root = Path(__file__).resolve().parents[1]
    sources = [root / rel for rel in carried_files()]
    hashes.update({str(p): sha256_file(p) for p in sources})
    planned = [PlannedFile(f"{CARRIED}/trtllm_dflash/{p.relative_to(root)}", p.stat().st_size, p) for p in sources]

    def run(tmp: Path, progress):
        for f in planned:
            (tmp / f.rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f.source, tmp / f.rel)  # a copy, not a link: the deployment outlives this install

    return Step(
        "package",
        f"carry trtllm_dflash's code into {CARRIED}/ (the Triton models import it)",
        planned,
        {f.rel: hashes[str(f.source)] for f in planned},
        run,
    )


def steps(opts, dep: Deployment, sources, hashes: dict[str, str]) -> list:
    out = []
    draft_files = list(dep.draft_files)
    if dep.local:
        out += target_steps(sources, dep.quantize, hashes)
        draft_files = sources.draft_files
    else:
        hashes.update({str(p): sha256_file(p) for p in draft_files})
    if draft_files:
        out.append(
            stage_step(
                "draft_checkpoint", "stage the DFlash draft (z-lab format)", "checkpoints/draft", draft_files, hashes
            )
        )
    params = RepoParams(
        max_batch_size=dep.recipe.max_batch_size,
        max_seq_len=dep.recipe.max_seq_len,
        tokenizer_dir=dep.tokenizer_ref,
        apply_chat_template=opts.chat_template,
        engine_model=ENGINE_MODEL,
        chat_template_kwargs=json.dumps(dep.template_kwargs),
    )
    out.append(template_step(params))
    out.append(carried_package_step(hashes))
    out.append(
        text_step(
            "engine_options",
            "write the LLM-API options: model.yaml (Triton) and trtllm-serve.yaml",
            {MODEL_YAML: model_yaml(dep), SERVE_YAML: serve_yaml(dep)},
        )
    )
    out.append(
        text_step(
            "launch",
            "write launch.sh and DEPLOY.md for the GPU host",
            {"launch.sh": launch_sh(dep), "DEPLOY.md": deploy_md(dep)},
            executable=("launch.sh",),
        )
    )
    out.append(dynamo_step(dep))
    return out


def dynamo_step(dep: Deployment) -> Step:
    """dynamo/: the same deployment served by NVIDIA Dynamo (deploy/dynamo.py), on one host or on Kubernetes."""
    from trtllm_dflash.deploy.schedule import recipe_acceptance

    r, options = dep.recipe, dep.dynamo_options()
    engine = dynamo.engine_yaml(options_yaml(options))
    served, gpus = r.model, r.num_gpus
    draft_len = (options.get("speculative_config") or {}).get("max_draft_len") or 0
    acceptance = recipe_acceptance(r) if draft_len else None
    ais = dynamo.AisAcceptance.of(acceptance.conditional, draft_len, acceptance.source) if acceptance else None
    dgd = dynamo.graph(
        name=dynamo.graph_name(r.model),
        model=dep.serve_target,
        served=served,
        replicas=dep.replicas,
        gpus_per_worker=gpus,
        local=dep.local,
        ais=ais,
    )
    launch = dynamo.launch_sh(
        model=dep.serve_target, served=served, replicas=dep.replicas, gpus_per_worker=gpus, recipe_id=r.id, ais=ais
    )
    files = {
        dynamo.ENGINE_YAML: engine,
        f"{dynamo.FOLDER}/launch.sh": launch,
        f"{dynamo.FOLDER}/graph.yaml": dynamo.graph_yaml(dgd, engine),
    }
    return text_step(
        "dynamo",
        f"write dynamo/: engine options, launch.sh and a DynamoGraphDeployment of {dep.replicas} worker(s)",
        files,
        executable=(f"{dynamo.FOLDER}/launch.sh",),
    )
