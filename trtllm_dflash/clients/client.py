"""A tritonclient gRPC client for the `ensemble` model (Triton TensorRT-LLM tensor names).

The dflash model is decoupled, so gRPC requests always go over the bidirectional stream
(`stream_infer`); with `stream=False` the server answers with one response holding the whole text.
Time to first token and tokens/s are measured here, at the client, as a user sees them.
`EnsembleStream` is the one request/response path; `complete` (the CLI) and the OpenAI frontend drive it.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from trtllm_dflash.config import SamplingParams
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.serving import protocol


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    max_tokens: int = 128
    stream: bool = True
    sampling: SamplingParams = SamplingParams()
    stop_words: tuple[str, ...] = ()
    model: str = "ensemble"
    apply_chat_template: bool | None = None  # None: the build's choice

    def inputs(self):
        """Batch dimension first, as the ensemble has max_batch_size > 0: text_input is [1, 1].

        top_p and top_k always go along: in TensorRT-LLM's meaning a temperature alone decodes greedily.
        """
        import tritonclient.grpc as grpcclient

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
        if self.apply_chat_template is not None:
            arrays["apply_chat_template"] = np.array([[self.apply_chat_template]], dtype=bool)
        out = []
        for name, arr in arrays.items():
            t = grpcclient.InferInput(name, list(arr.shape), protocol.BY_NAME[name].datatype)
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
    draft_counts_estimated: bool = False  # the server inferred the two counts above from its iteration count
    acceptance_length: float = 0.0
    cached_tokens: int = 0  # prompt tokens the server copied from its prefix cache
    finish_reason: str = ""
    time_to_first_token: float = 0.0
    wall_time: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def summary(self) -> str:
        return (
            f"[{self.num_tokens} tokens, {self.tokens_per_second:.1f} tok/s, time to first token {self.time_to_first_token * 1000:.0f} ms, "
            f"acceptance length {self.acceptance_length:.2f} ({self.accepted_tokens}/{self.drafted_tokens} drafts accepted"
            f"{', estimated' if self.draft_counts_estimated else ''}), "
            f"finish {self.finish_reason or '?'}]"
        )

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "num_tokens": self.num_tokens,
            "acceptance_length": round(self.acceptance_length, 4),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_counts_estimated": self.draft_counts_estimated,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "time_to_first_token": round(self.time_to_first_token, 4),
            "wall_time": round(self.wall_time, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "responses": len(self.pieces),
        }


class Rejected(DFlashError):
    """The server answered the request with an error (bad input, or a failure inside a model)."""

    def __init__(self, reason: str):
        super().__init__(f"The server rejected the request: {reason}")
        self.reason = reason


class EnsembleStream:
    """One request on its own gRPC stream (one stream per client is all tritonclient allows).

    `on_response(result, error)` runs on gRPC's thread for each response, so a caller can hand them to a
    queue or an event loop; `read` folds one into `done`. `close` cancels the request unless its final
    response was read: cancelling a finished stream makes Triton 2.51 keep the ensemble referenced, and a
    later graceful shutdown then waits out its 30 s exit timeout.
    """

    def __init__(self, url: str, request: CompletionRequest, on_response: Callable):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self.done, self.finished = Completion(), False
        self.client = grpcclient.InferenceServerClient(url)
        try:
            try:
                self.client.is_server_live()
            except InferenceServerException:
                raise DFlashError(
                    f"Cannot reach Triton at {url}; start it with `trtdflash serve BUILD_DIR` or pass the right --url."
                ) from None
            self.client.start_stream(callback=on_response)
            self.t0 = time.perf_counter()
            self.client.async_stream_infer(
                request.model, request.inputs(), request_id=uuid.uuid4().hex, enable_empty_final_response=True
            )
        except InferenceServerException as e:
            self.close()
            raise DFlashError(f"Cannot talk to Triton at {url}: {e.message()}") from None
        except BaseException:
            self.close()
            raise

    def read(self, result, error) -> str:
        """Fold one response into `done`; returns its text ('' for the empty final response)."""
        if error is not None:
            raise Rejected(error.message() if hasattr(error, "message") else str(error))
        response, piece, done = result.get_response(), "", self.done
        if response.outputs:
            value = lambda name: result.as_numpy(name).reshape(-1)[0]  # noqa: E731
            piece = value(protocol.TEXT_OUTPUT).decode("utf-8")
            if not done.pieces:
                done.time_to_first_token = time.perf_counter() - self.t0
            done.pieces.append(piece)
            done.num_tokens = int(value("num_output_tokens"))
            done.drafted_tokens = int(value("total_draft_tokens"))
            done.accepted_tokens = int(value("total_accepted_draft_tokens"))
            done.draft_counts_estimated = bool(value("draft_counts_estimated"))
            done.acceptance_length = float(value("acceptance_length"))
            done.cached_tokens = int(value("num_cached_input_tokens"))
            done.finish_reason = value("finish_reason").decode()
        if response.parameters["triton_final_response"].bool_param:
            done.wall_time = time.perf_counter() - self.t0
            done.text = "".join(done.pieces)
            self.finished = True
        return piece

    def close(self) -> None:
        infer_stream = self.client._stream
        try:
            self.client.stop_stream(cancel_requests=not self.finished)
            if infer_stream is not None and not self.finished:
                # tritonclient 2.73 leaves its request-feeding thread waiting forever after a cancel; a long-running
                # frontend would keep one per disconnected client. The end marker it waits for lets it exit.
                infer_stream._request_queue.put(None)
        finally:
            self.client.close()


def complete(
    url: str, request: CompletionRequest, on_text: Callable[[str], None] | None = None, timeout: float = 600.0
) -> Completion:
    """Send one request over the gRPC stream; call on_text with each piece of text as it arrives."""
    responses: queue.Queue = queue.Queue()
    stream = EnsembleStream(url, request, lambda result, error: responses.put((result, error)))
    try:
        while not stream.finished:
            try:
                piece = stream.read(*responses.get(timeout=timeout))
            except queue.Empty:
                raise DFlashError(f"No response from {url} within {timeout:.0f} s.") from None
            if on_text and piece:
                on_text(piece)
        return stream.done
    finally:
        stream.close()
