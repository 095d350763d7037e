"""A TensorRT-LLM deployment served by NVIDIA Dynamo: `dynamo/` beside `triton_repo/`, written by every GPU build.

Dynamo 1.6.x pins TensorRT-LLM DYNAMO_TRTLLM (the `[trtllm]` extra of the ai-dynamo 1.6.1 wheel) in the image its
own templates name (DYNAMO_IMAGE), which also carries `dynamo.trtllm`: the first image that serves DFlash out of the
box (no published Triton image carries a TensorRT-LLM with DFlash; DEPLOY.md). Three files:

    dynamo/engine.yaml         the LLM-API options (trtllm-serve.yaml's, validated against DYNAMO_TRTLLM's rules),
                               read by `python -m dynamo.trtllm --extra-engine-args`, which merges them over its flags
    dynamo/launch.sh           one host: Dynamo's frontend with the KV router and `replicas` workers of `tp` GPUs each,
                               file discovery and ZMQ events (no etcd, no NATS), inside DYNAMO_IMAGE
    dynamo/graph.yaml          Kubernetes: a DynamoGraphDeployment (nvidia.com/v1beta1) shaped as the aggregated
                               TensorRT-LLM template the ai-dynamo wheel ships (profiler/templates/dgd/trtllm/agg.yaml),
                               and the ConfigMap that holds engine.yaml, mounted where --extra-engine-args reads it

Aggregated only: a disaggregated generation worker drafts without the prompt's hidden states (deploy/lint.py).
Workers publish KV events (`--publish-kv-events`), so the router sends a conversation's next turn to the replica
that holds its prefix, and metrics (`--publish-metrics`), where Dynamo's planner reads acceptance.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

DYNAMO_RELEASE = "1.6.1"
DYNAMO_TRTLLM = "1.3.0rc29"  # ai-dynamo 1.6.1's `[trtllm]` extra: tensorrt-llm==1.3.0rc29
DYNAMO_IMAGE = f"nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:{DYNAMO_RELEASE}"
DYNAMO_MODES = ("agg", "disagg")  # what `build --dynamo-mode` takes; the lint refuses disagg with a draft
FOLDER = "dynamo"
ENGINE_YAML = f"{FOLDER}/engine.yaml"
CONFIG_MOUNT = "/etc/trtdflash"  # where the graph mounts engine.yaml (a ConfigMap key, by subPath)
HF_SECRET = "hf-token-secret"  # the Secret the template's pods read HF_TOKEN from
DEPLOYMENT_MOUNT = "/deploy"  # where the graph mounts a build with local weights (a volume the operator provides)


AIS_POSITIONS = 5  # draft positions Dynamo's AIS estimator models (dynamo/_internal/ais.py _NEXTN_ACCEPT_RATES_LEN)


@dataclass(frozen=True)
class AisAcceptance:
    """The draft's acceptance as Dynamo's AISimulate estimator reads it (DYN_AIS_NEXTN, DYN_AIS_NEXTN_ACCEPT_RATES:
    the defaults of `--ais-nextn` and `--ais-nextn-accept-rates` on the frontend, the router and the mocker), in place
    of its default [0.85, 0.3, 0, 0, 0]; it models five positions at most, so a longer draft's later positions are
    left out, and `left_out` says how many tokens per step they would have added."""

    nextn: int
    rates: tuple[float, ...]  # entry i: P(draft i accepted | every earlier draft accepted)
    left_out: float
    source: str

    @classmethod
    def of(cls, conditional: Sequence[float], draft_len: int, source: str) -> AisAcceptance:
        from trtllm_dflash.engine.plan import expected_tokens

        n = min(draft_len, AIS_POSITIONS)
        rates = tuple(conditional[:n]) + (0.0,) * (n - len(conditional[:n]))
        return cls(n, rates, expected_tokens(conditional, draft_len) - expected_tokens(conditional, n), source)

    def env(self) -> dict[str, str]:
        return {
            "DYN_AIS_NEXTN": str(self.nextn),
            "DYN_AIS_NEXTN_ACCEPT_RATES": ",".join(f"{p:.4f}" for p in self.rates),
        }

    def note(self) -> str:
        left = f"; positions past the fifth, left out, would add {self.left_out:.2f} tokens per step" * (
            self.left_out > 0.005
        )
        return f"acceptance for Dynamo's AIS estimator from {self.source}{left}"


def engine_yaml(options_text: str) -> str:
    """engine.yaml: the options as YAML (trtllm_backend.options_yaml) under a header that says what reads them."""
    return (
        f"# python3 -m dynamo.trtllm --model MODEL --extra-engine-args {ENGINE_YAML}: TensorRT-LLM's LLM-API options, "
        "merged over the\n"
        f"# worker's flags; written and validated against TensorRT-LLM {DYNAMO_TRTLLM} (Dynamo {DYNAMO_RELEASE}'s) by "
        "trtdflash build. Relative paths are relative to the build folder.\n" + options_text
    )


def worker_args(model: str, served: str, engine_path: str) -> list[str]:
    """`python3 -m dynamo.trtllm`'s arguments: the model, the options file, KV events and metrics, aggregated."""
    return [
        "--model",
        model,
        "--served-model-name",
        served,
        "--extra-engine-args",
        engine_path,
        "--publish-kv-events",
        "--publish-metrics",
        "--disaggregation-mode",
        "agg",
    ]


def launch_sh(
    *, model: str, served: str, replicas: int, gpus_per_worker: int, recipe_id: str, ais: AisAcceptance | None
) -> str:
    need = replicas * gpus_per_worker
    args = " ".join(shlex.quote(a) for a in worker_args(model, served, ENGINE_YAML))
    exports = "".join(f"export {k}=${{{k}:-{v}}}\n" for k, v in (ais.env() if ais else {}).items())
    exports = f"# The {ais.note()}.\n{exports}" if ais else ""
    return f"""#!/usr/bin/env bash
# Serve this DFlash deployment ({recipe_id}) with NVIDIA Dynamo {DYNAMO_RELEASE} on one host: the frontend (OpenAI API on
# HTTP_PORT, default 8000; KV router) and {replicas} TensorRT-LLM worker(s) of {gpus_per_worker} GPU(s) each ({need} GPUs).
# Run it inside {DYNAMO_IMAGE} (TensorRT-LLM {DYNAMO_TRTLLM}), from the build folder: ./dynamo/launch.sh
# Discovery is a folder (no etcd), events go over ZMQ (no NATS). Ctrl-C stops every process. Past one host, deploy
# dynamo/graph.yaml on Kubernetes instead (DEPLOY.md).
set -euo pipefail
cd "$(dirname "$0")/.."
http=${{HTTP_PORT:-8000}}
need={need}
have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "$have" -lt "$need" ]; then
  echo "{replicas} worker(s) of {gpus_per_worker} GPU(s) need $need GPUs; nvidia-smi sees $have (fewer replicas: trtdflash build --replicas)." >&2
  exit 2
fi
python3 -c "import dynamo.trtllm" 2>/dev/null || {{ echo "Dynamo's TensorRT-LLM worker is not installed here; run this inside {DYNAMO_IMAGE}." >&2; exit 2; }}
{exports}export DYN_FILE_KV="${{DYN_FILE_KV:-$PWD/.dynamo/discovery}}"
mkdir -p "$DYN_FILE_KV"
plane="--discovery-backend file --event-plane zmq"
pids=()
trap 'kill -TERM "${{pids[@]}}" 2>/dev/null; wait' INT TERM EXIT
python3 -m dynamo.frontend --http-port "$http" --router-mode kv $plane &
pids+=($!)
for i in $(seq 0 $(({replicas} - 1))); do
  first=$((i * {gpus_per_worker}))
  devices=$(seq -s, "$first" $((first + {gpus_per_worker} - 1)))
  CUDA_VISIBLE_DEVICES="$devices" python3 -m dynamo.trtllm {args} $plane &
  pids+=($!)
done
wait -n "${{pids[@]}}" || true
echo "A Dynamo process exited; stopping the others." >&2
"""


def graph_name(model: str) -> str:
    """A Kubernetes name (DNS-1123: lower-case letters, digits, '-') for the deployment of `model`."""
    return (re.sub(r"[^a-z0-9-]+", "-", model.lower()).strip("-")[:50] or "model") + "-dflash"


def graph(
    *, name: str, model: str, served: str, replicas: int, gpus_per_worker: int, local: bool, ais: AisAcceptance | None
) -> dict:
    """The DynamoGraphDeployment, in the aggregated TensorRT-LLM template's shape: a frontend (KV router) and a worker
    component of `replicas` pods with `gpus_per_worker` GPUs each, engine.yaml mounted from the ConfigMap
    `{name}-engine` (graph_yaml writes both)."""
    config_map = f"{name}-engine"
    mounts = [{"name": "engine", "mountPath": f"{CONFIG_MOUNT}/engine.yaml", "subPath": "engine.yaml"}]
    volumes = [{"name": "engine", "configMap": {"name": config_map}}]
    token = [{"secretRef": {"name": HF_SECRET}}]  # as the template: gated weights need the operator's HF token
    acceptance = [{"name": k, "value": v} for k, v in (ais.env() if ais else {}).items()]
    worker = {
        "args": worker_args(model, served, f"{CONFIG_MOUNT}/engine.yaml"),
        "command": ["python3", "-m", "dynamo.trtllm"],
        **({"env": acceptance} if acceptance else {}),
        "envFrom": token,
        "image": DYNAMO_IMAGE,
        "name": "main",
        "resources": {"limits": {"nvidia.com/gpu": str(gpus_per_worker)}},
        "volumeMounts": mounts,
    }
    if local:  # the weights are in the build folder: mounted read-only from a volume the operator fills with it
        mounts.append({"name": "deployment", "mountPath": DEPLOYMENT_MOUNT, "readOnly": True})
        volumes.append({"name": "deployment", "persistentVolumeClaim": {"claimName": f"{name}-deployment"}})
        worker["workingDir"] = DEPLOYMENT_MOUNT
    frontend = {
        "args": ["-m", "dynamo.frontend"],
        "command": ["python3"],
        "env": [{"name": "DYN_ROUTER_MODE", "value": "kv"}, *acceptance],
        "envFrom": token,
        "image": DYNAMO_IMAGE,
        "name": "main",
    }
    dgd = {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {
            "components": [
                {
                    "name": "Frontend",
                    "podTemplate": {"spec": {"containers": [frontend]}},
                    "replicas": 1,
                    "type": "frontend",
                },
                {
                    "name": "TRTLLMWorker",
                    "podTemplate": {"spec": {"containers": [worker], "volumes": volumes}},
                    "replicas": replicas,
                    "type": "worker",
                },
            ]
        },
    }
    return dgd


def graph_yaml(dgd: dict, engine_text: str) -> str:
    name = f"{dgd['metadata']['name']}-engine"
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"engine.yaml": engine_text}}
    header = (
        f"# kubectl apply -f {FOLDER}/graph.yaml: the Dynamo operator ({DYNAMO_RELEASE}) runs a frontend with the KV router\n"
        "# and the TensorRT-LLM workers; the ConfigMap holds engine.yaml. Written by trtdflash build.\n"
    )
    return header + yaml.dump_all([cm, dgd], Dumper=_BlockDumper, sort_keys=False, default_flow_style=False)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's engine.yaml) as literal blocks, readable as the file they hold."""


_BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)
