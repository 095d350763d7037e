"""A tritonclient gRPC client for the `ensemble` model (Triton TensorRT-LLM tensor names).

The dflash model is decoupled, so gRPC requests always go over the bidirectional stream
(`stream_infer`); with `stream=False` the server answers with one response holding the whole text.
Time to first token and tokens/s are measured here, at the client, as a user sees them.
"""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .config import SamplingParams
from .errors import DFlashError

STAT_OUTPUTS = ("num_output_tokens", "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_length", "finish_reason")


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int = 128
    stream: bool = True
    sampling: SamplingParams = SamplingParams()
    stop_words: tuple[str, ...] = ()
    model: str = "ensemble"

    def inputs(self):
        """Batch dimension first, as the ensemble has max_batch_size > 0: text_input is [1, 1]."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import np_to_triton_dtype

        arrays = {
            "text_input": np.array([[self.prompt.encode("utf-8")]], dtype=np.object_),
            "max_tokens": np.array([[self.max_tokens]], dtype=np.int32),
            "stream": np.array([[self.stream]], dtype=bool),
            "temperature": np.array([[self.sampling.temperature]], dtype=np.float32),
            "top_p": np.array([[self.sampling.top_p]], dtype=np.float32),
            "top_k": np.array([[self.sampling.top_k]], dtype=np.int32),
        }
        if self.sampling.seed is not None:
            arrays["seed"] = np.array([[self.sampling.seed]], dtype=np.uint64)
        if self.stop_words:
            arrays["stop_words"] = np.array([[s.encode("utf-8") for s in self.stop_words]], dtype=np.object_)
        out = []
        for name, arr in arrays.items():
            t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == np.object_ else np_to_triton_dtype(arr.dtype))
            t.set_data_from_numpy(arr)
            out.append(t)
        return out


@dataclass
class Completion:
    text: str = ""
    pieces: list[str] = field(default_factory=list)
    num_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_length: float = 0.0
    finish_reason: str = ""
    time_to_first_token: float = 0.0
    wall_time: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text, "num_tokens": self.num_tokens, "acceptance_length": round(self.acceptance_length, 4),
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens, "finish_reason": self.finish_reason,
            "time_to_first_token": round(self.time_to_first_token, 4), "wall_time": round(self.wall_time, 4),
            "tokens_per_second": round(self.tokens_per_second, 3), "responses": len(self.pieces),
        }


def complete(url: str, request: CompletionRequest, on_text: Callable[[str], None] | None = None, timeout: float = 600.0) -> Completion:
    """Send one request over the gRPC stream; call on_text with each piece of text as it arrives."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue = queue.Queue()
    done, finished = Completion(), False
    client = grpcclient.InferenceServerClient(url)
    try:
        try:
            client.is_server_live()
        except InferenceServerException:
            raise DFlashError(f"Cannot reach Triton at {url}; start it with `trtdflash serve BUILD_DIR` or pass the right --url.") from None
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        t0 = time.perf_counter()
        client.async_stream_infer(request.model, request.inputs(), request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise DFlashError(f"No response from {url} within {timeout:.0f} s.") from None
            if error is not None:
                raise DFlashError(f"The server rejected the request: {error.message() if hasattr(error, 'message') else error}")
            response = result.get_response()
            if response.outputs:
                piece = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
                if not done.pieces:
                    done.time_to_first_token = time.perf_counter() - t0
                done.pieces.append(piece)
                if on_text and piece:
                    on_text(piece)
                done.num_tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                done.drafted_tokens = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
                done.accepted_tokens = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
                done.acceptance_length = float(result.as_numpy("acceptance_length").reshape(-1)[0])
                done.finish_reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            if response.parameters["triton_final_response"].bool_param:
                break
        done.wall_time = time.perf_counter() - t0
        done.text = "".join(done.pieces)
        finished = True
        return done
    except InferenceServerException as e:
        raise DFlashError(f"Cannot talk to Triton at {url}: {e.message()}") from None
    finally:
        try:
            # Cancel only what is still running: cancelling a finished stream makes Triton 2.51 keep the
            # ensemble referenced, and a later graceful shutdown then waits out its 30 s exit timeout.
            client.stop_stream(cancel_requests=not finished)
        finally:
            client.close()
