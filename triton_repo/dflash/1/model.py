"""Triton `dflash`: the embedded PyTorch DFlash runtime (draft + verify loop) as a decoupled python model.

Each request runs in its own thread and streams one response per verify step (text delta plus
running DFlash statistics); a lock serializes the steps, so concurrent streams interleave step by
step on one model copy. At most max_batch_size generations run at once (the build's memory
estimate assumes that many KV caches); later requests wait for a slot.

A request whose client went away is stopped at its next step, so it never holds the model:
directly through `response_sender.is_cancelled()`, and behind the ensemble through a marker that
postprocessing leaves (Triton 2.51 does not cancel a running ensemble step; see trtllm_dflash/cancel.py).
"""

import json
import threading
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from trtllm_dflash import cancel
from trtllm_dflash.config import SamplingParams
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.generate import GenerationStats
from trtllm_dflash.runtime import DFlashEngine

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0].item()


def _strings(request, name) -> list[str]:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    try:
        return [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in t.as_numpy().reshape(-1)]
    except UnicodeDecodeError:
        raise DFlashError(f"{name} is not valid UTF-8.") from None


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        param = lambda key: config["parameters"][key]["string_value"]  # noqa: E731
        here = Path(args["model_repository"])
        draft = param("draft_dir")
        self.engine = DFlashEngine.load(
            str(here / param("target_dir")), str(here / draft) if draft else None, no_draft=not draft,
            dtype=param("dtype"), block_size=int(param("block_size")), progress=pb_utils.Logger.log_info,
        )
        self.max_seq_len = int(param("max_seq_len"))
        self.vocab_rows = self.engine.target.vocab_rows
        self.step_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max(1, int(config["max_batch_size"])))  # concurrent generations
        self.stopping = threading.Event()
        self.threads: set[threading.Thread] = set()
        pb_utils.Logger.log_info(f"dflash ready: block size {self.engine.block_size}, draft {'yes' if self.engine.draft else 'no'}")

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True)
            self.threads.add(thread)
            thread.start()
        return None

    def _parse(self, request) -> dict:
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
        if ids.shape[0] != 1:
            raise DFlashError(f"Send one prompt per request (text_input of shape [1, 1]); got a batch of {ids.shape[0]}.")
        max_tokens = int(_scalar(request, "request_output_len", 0))
        if not 1 <= max_tokens <= self.max_seq_len:
            raise DFlashError(f"max_tokens must be between 1 and {self.max_seq_len}, got {max_tokens}.")
        if any(_strings(request, "bad_words")):
            raise DFlashError("bad_words is not supported by the dflash model yet; leave it empty.")
        end_id = _scalar(request, "end_id", None)
        if end_id is not None and not 0 <= end_id < self.vocab_rows:
            raise DFlashError(f"end_id must be a token id in 0..{self.vocab_rows - 1}, got {end_id}.")
        seed = _scalar(request, "seed", None)
        sampling = SamplingParams(
            float(_scalar(request, "temperature", 0.0)), float(_scalar(request, "runtime_top_p", 1.0)),
            int(_scalar(request, "runtime_top_k", 0)), None if seed is None else int(seed),
        )
        prompt_ids = ids.reshape(-1).tolist()
        exclude_input = bool(_scalar(request, "exclude_input_in_output", True))
        return {
            "prompt_ids": prompt_ids,
            "max_new_tokens": max_tokens,
            "sampling": sampling,
            "stop_strings": tuple(s for s in _strings(request, "stop_words") if s),
            "stop_token_ids": () if end_id is None else (int(end_id),),
            "streaming": bool(_scalar(request, "streaming", False)),
            "prefix": "" if exclude_input else self.engine.tokenizer.decode(prompt_ids, skip_special_tokens=True),
        }

    @staticmethod
    def _response(text: str, stats: GenerationStats, key: str):
        tensor = lambda name, value, dtype: pb_utils.Tensor(name, np.array([[value]], dtype=dtype))  # noqa: E731
        return pb_utils.InferenceResponse(output_tensors=[
            tensor("output_text", text.encode("utf-8"), np.object_),
            tensor("num_output_tokens", stats.num_tokens, np.int32),
            tensor("total_draft_tokens", stats.drafted_tokens, np.int32),
            tensor("total_accepted_draft_tokens", stats.accepted_tokens, np.int32),
            tensor("acceptance_length", stats.acceptance_length, np.float32),
            tensor("finish_reason", stats.finish_reason.encode(), np.object_),
            tensor("cancel_key", key.encode(), np.object_),
        ])

    def _serve(self, request, sender):
        steps, key, slot = None, uuid.uuid4().hex, False
        try:
            job = self._parse(request)
            while not self.slots.acquire(timeout=0.2):  # all slots busy: queue, but notice a client that left
                if sender.is_cancelled() or self.stopping.is_set():
                    sender.send(flags=FINAL)
                    return
            slot = True
            stats = GenerationStats()
            steps = self.engine.stream(job["prompt_ids"], max_new_tokens=job["max_new_tokens"], sampling=job["sampling"],
                                       stop_strings=job["stop_strings"], stop_token_ids=job["stop_token_ids"], stats=stats)
            pending = job["prefix"]
            while True:
                if sender.is_cancelled() or cancel.is_cancelled(key) or self.stopping.is_set():
                    pb_utils.Logger.log_info(f"dflash: request cancelled after {stats.num_tokens} tokens")
                    sender.send(flags=FINAL)
                    break
                with self.step_lock:
                    step = next(steps, None)
                pending += step[1] if step else ""
                if step is None or stats.finish_reason:
                    # The last response carries the FINAL flag itself: a separate flag-only final after an
                    # empty-text response leaves the ensemble holding the request (Triton 2.51; unload hangs).
                    sender.send(self._response(pending, stats, key), flags=FINAL)
                    break
                if job["streaming"] and pending:
                    sender.send(self._response(pending, stats, key))
                    pending = ""
        except DFlashError as e:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
        except Exception as e:  # a bug or a lost client: report it, keep serving others
            pb_utils.Logger.log_error(f"dflash: request failed: {type(e).__name__}: {e}")
            try:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {type(e).__name__}: {e}")), flags=FINAL)
            except Exception:
                pass
        finally:
            cancel.clear(key)
            if steps is not None:
                with self.step_lock:
                    steps.close()
            if slot:
                self.slots.release()
            self.threads.discard(threading.current_thread())

    def finalize(self):
        self.stopping.set()
        for thread in list(self.threads):
            thread.join(timeout=10)
        cancel.remove_all()
