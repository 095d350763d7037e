"""Triton `dflash`: the embedded PyTorch DFlash runtime (draft + verify loop) as a decoupled python model.

The request loop (parsing, slots, streaming, cancellation) is trtllm_dflash/engine_model.py, shared with the
TensorRT-LLM backend's `tensorrt_llm` model. Here one model copy serves every request: a lock serializes the
steps, so concurrent streams interleave step by step. At most max_batch_size generations run at once (the
build's memory estimate assumes that many KV caches); later requests wait for a slot.
"""

import json
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from trtllm_dflash.engine_model import EngineModel
from trtllm_dflash.runtime import DFlashEngine


class TritonPythonModel(EngineModel):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        param = lambda key: config["parameters"][key]["string_value"]  # noqa: E731
        here = Path(args["model_repository"])
        draft = param("draft_dir")
        self.engine = DFlashEngine.load(
            str(here / param("target_dir")), str(here / draft) if draft else None, no_draft=not draft,
            dtype=param("dtype"), block_size=int(param("block_size")), progress=pb_utils.Logger.log_info,
        )
        self.start(name="dflash", tokenizer=self.engine.tokenizer, max_seq_len=int(param("max_seq_len")),
                   vocab_rows=self.engine.target.vocab_rows, max_batch_size=int(config["max_batch_size"]), step_lock=threading.Lock())
        pb_utils.Logger.log_info(f"dflash ready: block size {self.engine.block_size}, draft {'yes' if self.engine.draft else 'no'}")

    def steps(self, job, stats):
        return self.engine.stream(job.prompt_ids, max_new_tokens=job.max_tokens, sampling=job.sampling, stop_strings=job.stop_strings,
                                  stop_token_ids=job.stop_token_ids, min_tokens=job.min_tokens, stats=stats)
