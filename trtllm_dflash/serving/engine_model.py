"""The request loop of both Triton engine models: `dflash` (the embedded runtime) and `tensorrt_llm` (TensorRT-LLM's
LLM API). One loop means a client cannot tell the backends apart: same parsing and errors (protocol.py), same
queueing for a slot, text deltas with running statistics per step, the same cancellation.

Each request runs in its own thread and streams one response per engine step. A request whose client went away
is stopped at its next step: directly through `response_sender.is_cancelled()`, and behind the ensemble through
a marker that postprocessing leaves (Triton 2.51 does not cancel a running ensemble step; see cancel.py).
Importable only inside Triton's python backend (it needs `triton_python_backend_utils`).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import triton_python_backend_utils as pb_utils

from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.serving import cancel, protocol

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _array(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _response(text: str, stats: GenerationStats, times: protocol.RequestTimes, key: str):
    arrays = protocol.response_arrays(text, stats, times, key)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, a) for name, a in arrays.items()])


class EngineModel:
    """Subclasses call `start(...)` from `initialize` and implement `steps`."""

    def start(self, *, name: str, tokenizer, max_seq_len: int, vocab_rows: int, max_batch_size: int) -> None:
        self.name, self.tokenizer, self.max_seq_len, self.vocab_rows = name, tokenizer, max_seq_len, vocab_rows
        self.slots = threading.BoundedSemaphore(max(1, max_batch_size))  # concurrent generations
        self.stopping = threading.Event()
        self.threads: set[threading.Thread] = set()

    def steps(self, job: protocol.EngineRequest, stats: GenerationStats, poll) -> Iterator[tuple[list[int], str]]:
        """(new token ids, new text) per engine step, filling `stats`; closing it stops the generation.
        `poll()` is True once the client is gone (for engines that wait on their own queue)."""
        raise NotImplementedError

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True)
            self.threads.add(thread)
            thread.start()
        return None

    def _serve(self, request, sender):
        steps, key, slot, times = None, uuid.uuid4().hex, False, protocol.RequestTimes()
        try:
            job = protocol.parse_request(
                lambda name: _array(request, name), max_seq_len=self.max_seq_len, vocab_rows=self.vocab_rows
            )
            gone = lambda: sender.is_cancelled() or cancel.is_cancelled(key) or self.stopping.is_set()  # noqa: E731
            while not self.slots.acquire(timeout=0.2):  # all slots busy: queue, but notice a client that left
                if gone():
                    sender.send(flags=FINAL)
                    return
            slot = True
            times.schedule()
            stats = GenerationStats()
            steps = self.steps(job, stats, gone)
            pending = "" if job.exclude_input else self.tokenizer.decode(job.prompt_ids, skip_special_tokens=True)
            while True:
                if gone():
                    pb_utils.Logger.log_info(f"{self.name}: request cancelled after {stats.num_tokens} tokens")
                    sender.send(flags=FINAL)
                    break
                step = next(steps, None)
                if step and step[0]:
                    times.token()
                pending += step[1] if step else ""
                if step is None or stats.finish_reason:
                    # The last response carries the FINAL flag itself: a separate flag-only final after an
                    # empty-text response leaves the ensemble holding the request (Triton 2.51; unload hangs).
                    sender.send(_response(pending, stats, times, key), flags=FINAL)
                    break
                if job.streaming and pending:
                    sender.send(_response(pending, stats, times, key))
                    pending = ""
        except DFlashError as e:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
        except Exception as e:  # a bug or a lost client: report it, keep serving others
            pb_utils.Logger.log_error(f"{self.name}: request failed: {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {type(e).__name__}: {e}")),
                    flags=FINAL,
                )
        finally:
            cancel.clear(key)
            if steps is not None:
                steps.close()
            if slot:
                self.slots.release()
            self.threads.discard(threading.current_thread())

    def finalize(self):
        self.stopping.set()
        for thread in list(self.threads):
            thread.join(timeout=10)
        cancel.remove_all()
