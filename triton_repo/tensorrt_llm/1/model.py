"""Triton `tensorrt_llm`: the TensorRT-LLM backend's engine step, on `tensorrt_llm.LLM` (imported lazily).

model.yaml (beside this file) holds the LLM-API options `trtdflash build` validated; relative paths in it are
relative to this folder, so a build can be moved. TensorRT-LLM batches requests in flight itself, so requests
are not serialized here. With TRTDFLASH_LLM_ENGINE=embedded (CPU machines, CI) the same code runs on our
embedded engine behind the same API surface (trtllm_dflash/deploy/trtllm/embedded.py).
"""

import json
import os
import sys
from pathlib import Path

# A GPU deployment carries the trtllm_dflash its models import in python/ beside triton_repo/ (NVIDIA's container has
# no such package); the python backend's stub runs its interpreter isolated, so PYTHONPATH cannot add it.
_CARRIED = Path(__file__).resolve().parents[3] / "python"
if _CARRIED.is_dir():
    sys.path.insert(0, str(_CARRIED))

import triton_python_backend_utils as pb_utils
import yaml

from trtllm_dflash.deploy.trtllm.llm_steps import clear_mpi_job_env, llm_steps
from trtllm_dflash.resolve import local_or_id
from trtllm_dflash.serving.engine_model import EngineModel

ENGINE_ENV = "TRTDFLASH_LLM_ENGINE"


def _llm_api():
    if os.environ.get(ENGINE_ENV) == "embedded":
        from trtllm_dflash.deploy.trtllm.embedded import LLM, SamplingParams
    else:
        from tensorrt_llm import LLM, SamplingParams
    return LLM, SamplingParams


class TritonPythonModel(EngineModel):
    def initialize(self, args):
        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        here = Path(args["model_repository"]) / args["model_version"]
        options = {k: v for k, v in yaml.safe_load((here / "model.yaml").read_text()).items() if k != "triton_config"}
        options["model"] = local_or_id(options["model"], here)
        spec = options.get("speculative_config") or {}
        if "speculative_model" in spec:
            spec["speculative_model"] = local_or_id(spec["speculative_model"], here)
        if cleared := clear_mpi_job_env():  # before tensorrt_llm (and so mpi4py) is imported
            pb_utils.Logger.log_info(f"tensorrt_llm: cleared the launcher's MPI job variables {', '.join(cleared)}")
        LLM, self.sampling_params = _llm_api()
        pb_utils.Logger.log_info(f"tensorrt_llm: starting {LLM.__module__}.LLM with {options}")
        self.llm = LLM(**options)
        self.max_draft_len = int(spec.get("max_draft_len", 0))
        param = lambda key: config["parameters"][key]["string_value"]  # noqa: E731
        tokenizer = AutoTokenizer.from_pretrained(local_or_id(param("tokenizer_dir"), Path(args["model_repository"])))
        self.start(
            name="tensorrt_llm",
            tokenizer=tokenizer,
            max_seq_len=int(param("max_seq_len")),
            vocab_rows=len(tokenizer),
            max_batch_size=int(config["max_batch_size"]),
        )  # TensorRT-LLM (or the embedded LLM) schedules the steps

    def steps(self, job, stats, poll):
        return llm_steps(self.llm, self.sampling_params, job, stats, self.tokenizer, self.max_draft_len)

    def finalize(self):
        super().finalize()
        self.llm.shutdown()
