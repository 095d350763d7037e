"""An OpenAI-compatible HTTP API in front of the Triton `ensemble`, for tools that speak only OpenAI (AIPerf, the SDK).

Each request becomes one gRPC streaming request to the ensemble through `client.EnsembleStream`.
Chat requests are rendered here with the build's tokenizer chat template (the whole conversation, with
the generation prompt) and sent with `apply_chat_template=false`, as completions prompts are; prompt
tokens are counted with that tokenizer the way the preprocessing model counts them.
Defaults follow OpenAI (temperature 1, completions max_tokens 16, chat: the rest of the context window).
Parameters the runtime cannot honour get a 400 instead of being ignored; unknown fields are ignored.
A client that goes away cancels its Triton request (aiohttp cancels the handler on disconnect).
Runs on its own event loop in a thread of the process that owns tritonserver (`serve.TritonServer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from pathlib import Path

from aiohttp import web

from trtllm_dflash.clients.client import CompletionRequest, EnsembleStream, Rejected
from trtllm_dflash.config import SamplingParams
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import preset_for
from trtllm_dflash.serving.protocol import MAX_STRING_CHARS, MAX_STRINGS
from trtllm_dflash.text import encode_prompt

log = logging.getLogger(__name__)

# Parameters whose only supported value is their default (None always means the default).
FIXED = {
    "n": (1, "one choice per request"),
    "best_of": (1, "one choice per request"),
    "echo": (False, "the prompt is not echoed"),
    "logprobs": (False, "log probabilities are not returned"),
    "top_logprobs": (0, "log probabilities are not returned"),
    "presence_penalty": (0, "the DFlash runtime has no penalties"),
    "frequency_penalty": (0, "the DFlash runtime has no penalties"),
    "logit_bias": ({}, "the DFlash runtime has no logit bias"),
}
MAX_BODY = 1 << 20  # bytes of one request body: far above any prompt the context window holds
KINDS = {  # JSON type name -> check
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
}


def model_id(manifest: dict) -> str:
    """The name clients address: the target preset, or the target directory's name."""
    target = manifest["options"]["target"]
    return target if preset_for(target) else Path(target).name


class APIError(Exception):
    """Answered as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def _field(body: dict, name: str, kind: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not KINDS[kind](value):
        raise APIError(400, f"'{name}' must be {kind}, got {json.dumps(value)}.", name)
    return value


def _check_fixed(body: dict) -> None:
    for name, (default, why) in FIXED.items():
        value = body.get(name)
        if value is not None and value != default:
            raise APIError(
                400,
                f"{name}={json.dumps(value)} is not supported ({why}); leave it out or send {json.dumps(default)}.",
                name,
            )


# apply_chat_template's own arguments: a request's template options may not reach them
TEMPLATE_RESERVED = frozenset(
    ("conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message")
    + (
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
    )
    + ("tokenizer_kwargs",)
)


def _template_kwargs(body: dict) -> dict:
    """vLLM's `chat_template_kwargs`: variables the chat template reads (enable_thinking, ...), never the renderer's
    own arguments."""
    options = _field(body, "chat_template_kwargs", "an object", {})
    if reserved := sorted(TEMPLATE_RESERVED & set(options)):
        raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}.", "chat_template_kwargs")
    return options


def _stop_words(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or a list of strings.", "stop")
    if len(stop) > MAX_STRINGS or any(len(s) > MAX_STRING_CHARS for s in stop):
        raise APIError(
            400, f"'stop' takes at most {MAX_STRINGS} strings of at most {MAX_STRING_CHARS} characters.", "stop"
        )
    return tuple(s for s in stop if s)


def _message_text(message, i: int) -> tuple[str, str]:
    """(role, text) of one chat message; content may be a string or a list of text parts."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(400, f"messages[{i}] must be an object with a 'role' string.", "messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message["role"], content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return message["role"], "".join(p["text"] for p in content)
    raise APIError(
        400,
        f'messages[{i}].content must be a string or a list of text parts ({{"type": "text", "text": ...}}); '
        "this model reads text only.",
        "messages",
    )


def _finish_reason(ensemble_reason: str) -> str:
    return "length" if ensemble_reason == "length" else "stop"


class OpenAIFrontend:
    """The HTTP server; `start()` binds and serves on a thread of its own, `stop()` cancels what is in flight."""

    def __init__(self, build_dir: Path, manifest: dict, grpc_url: str, host: str, port: int):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(Path(build_dir) / "tokenizer")
        self.model = model_id(manifest)
        self.max_seq_len = manifest["resolved"]["max_seq_len"]
        self.created = int(time.time())
        self.grpc_url, self.host, self.port = grpc_url, host, port
        self.loop: asyncio.AbstractEventLoop | None = None
        self.runner: web.AppRunner | None = None
        self.thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> OpenAIFrontend:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise DFlashError(
                f"Cannot use {self.host}:{self.port} ({e.strerror}); pick another --openai-port or stop what is listening there."
            ) from None
        self.port = sock.getsockname()[1]
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY)  # larger bodies get a 413
        app.add_routes(
            [
                web.get("/v1/models", self._models),
                web.get("/v1/models/{model:.+}", self._model),
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/health", self._health),
            ]
        )
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its Triton request.
        # shutdown_timeout: on stop, requests in flight get a second to finish, then they are cancelled (see _shutdown).
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.SockSite(self.runner, sock).start())
        except BaseException:
            sock.close()
            self.loop.close()
            raise
        self.thread = threading.Thread(target=self._serve, name="openai-frontend", daemon=True)
        self.thread.start()
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()

    async def _shutdown(self) -> None:
        """Stop listening and close connections; aiohttp cancels a late handler without awaiting it, so await every
        task left here, which runs the handlers' cleanup: each cancels its Triton request."""
        await self.runner.cleanup()
        rest = asyncio.all_tasks() - {asyncio.current_task()}
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def stop(self, timeout: float = 15.0) -> None:
        if self.thread is None or not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)

    # ---- plumbing --------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every failure is OpenAI's error JSON; a bug is logged here and reported as a 500, never a traceback."""
        try:
            return await handler(request)
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # unknown route or method
            return web.json_response(
                APIError(e.status, f"{request.method} {request.path}: {e.reason}.").body(), status=e.status
            )
        except Exception as e:
            log.exception("OpenAI frontend: %s %s failed", request.method, request.path)
            return web.json_response(
                APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(), status=500
            )

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (
            ValueError,
            RecursionError,
        ):  # JSONDecodeError and UnicodeDecodeError are ValueErrors; RecursionError: nesting
            raise APIError(400, "The request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object.")
        name = _field(body, "model", "a string", self.model)
        if name not in (self.model, "ensemble"):
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model}'.",
                "model",
                code="model_not_found",
            )
        return body

    async def _generate(self, request: CompletionRequest):
        """Yields each response's text piece with the running Completion; leaving early cancels the Triton request."""
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue = asyncio.Queue()
        on_response = lambda result, error: loop.call_soon_threadsafe(responses.put_nowait, (result, error))  # noqa: E731
        try:
            stream = await loop.run_in_executor(None, EnsembleStream, self.grpc_url, request, on_response)
        except DFlashError as e:
            raise APIError(503, str(e), type="server_error") from None
        try:
            while not stream.finished:
                piece = stream.read(*await responses.get())
                yield piece, stream.done
        except Rejected as e:
            internal = e.reason.startswith("internal error")
            raise APIError(
                500 if internal else 400, e.reason, type="server_error" if internal else "invalid_request_error"
            ) from None
        finally:
            await asyncio.shield(loop.run_in_executor(None, stream.close))

    # ---- endpoints -------------------------------------------------------------------------------

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "trtllm-dflash"}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] not in (self.model, "ensemble"):
            raise APIError(
                404, f"The model '{request.match_info['model']}' does not exist.", "model", code="model_not_found"
            )
        return web.json_response(self._model_card())

    async def _health(self, request: web.Request) -> web.Response:
        import tritonclient.grpc as grpcclient

        def ready() -> bool:
            with contextlib.closing(grpcclient.InferenceServerClient(self.grpc_url)) as client:
                try:
                    return client.is_server_ready()
                except Exception:  # unreachable counts as not ready
                    return False

        return web.Response(status=200 if await asyncio.get_running_loop().run_in_executor(None, ready) else 503)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError(
                400,
                "'prompt' must be a string (or a list holding one string); token-id prompts and batches are not supported.",
                "prompt",
            )
        return await self._respond(request, body, prompt, _field(body, "max_tokens", "an integer", 16), chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of messages.", "messages")
        turns = [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]
        if not self.tokenizer.chat_template:
            raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", "messages")
        options = _template_kwargs(body)
        try:
            prompt = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **options)
        except Exception as e:  # the template's own checks (e.g. role order) raise jinja errors
            raise APIError(400, f"The chat template cannot render these messages: {e}", "messages") from None
        max_tokens = _field(body, "max_completion_tokens", "an integer")
        return await self._respond(
            request,
            body,
            prompt,
            _field(body, "max_tokens", "an integer") if max_tokens is None else max_tokens,
            chat=True,
        )

    async def _respond(
        self, request: web.Request, body: dict, prompt: str, max_tokens: int | None, chat: bool
    ) -> web.StreamResponse:
        """Both endpoints: check the parameters, run the request, answer as one JSON object or as server-sent events."""
        _check_fixed(body)
        try:
            prompt_tokens = len(encode_prompt(self.tokenizer, prompt, False, self.max_seq_len))
            top_k = _field(body, "top_k", "an integer", 0)
            sampling = SamplingParams(
                _field(body, "temperature", "a number", 1.0),
                _field(body, "top_p", "a number", 1.0),
                0 if top_k == -1 else top_k,
                _field(body, "seed", "an integer"),
            )  # vLLM: top_k -1 = off
        except DFlashError as e:
            raise APIError(400, str(e)) from None
        room = self.max_seq_len - prompt_tokens
        if max_tokens is not None and not 1 <= max_tokens <= room:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}, but the prompt takes {prompt_tokens} of the {self.max_seq_len}-token context "
                f"window; ask for 1 to {room} tokens.",
                "max_tokens",
            )
        stream = _field(body, "stream", "a boolean", False)
        stream_options = _field(body, "stream_options", "an object", {})
        include_usage = stream and _field(stream_options, "include_usage", "a boolean", False)
        # vLLM's extension: usage in every chunk, so a client counts each step's tokens (SPEED-Bench's acceptance)
        continuous = include_usage and _field(stream_options, "continuous_usage_stats", "a boolean", False)
        job = CompletionRequest(
            prompt,
            room if max_tokens is None else max_tokens,
            stream,
            sampling,
            _stop_words(body),
            apply_chat_template=False,
        )
        reply = _Reply(chat, body.get("model") or self.model)
        async with contextlib.aclosing(self._generate(job)) as responses:
            if not stream:
                async for _, done in responses:  # noqa: B007  (the last response holds the whole answer)
                    pass
                return web.json_response(reply.whole(done, prompt_tokens))
            first = await anext(responses)  # a rejected request still gets its 400 before the stream opens
            sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await sse.prepare(request)
            send = lambda obj: sse.write(f"data: {json.dumps(obj)}\n\n".encode())  # noqa: E731
            try:
                if chat:
                    await send(reply.chunk({"role": "assistant", "content": ""}))
                item = first
                while item is not None:
                    piece, done = item
                    if piece:
                        chunk = reply.chunk({"content": piece} if chat else piece)
                        await send(chunk | {"usage": reply.usage(done, prompt_tokens)} if continuous else chunk)
                    item = await anext(responses, None)
                await send(reply.chunk({} if chat else "", done))
                if include_usage:
                    await send(reply.usage_chunk(done, prompt_tokens))
            except APIError as e:  # failed after the stream opened: the error travels as an event
                await send(e.body())
            await sse.write(b"data: [DONE]\n\n")
            await sse.write_eof()
            return sse


class _Reply:
    """OpenAI's response shapes for one request (completions or chat, whole or chunked)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model, self.created = chat, model, int(time.time())
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def usage(done, prompt_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": done.num_tokens,
            "total_tokens": prompt_tokens + done.num_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        }

    @staticmethod
    def _dflash(done) -> dict:
        """Our extension: how well the draft did (OpenAI clients ignore unknown fields)."""
        return {
            "acceptance_length": round(done.acceptance_length, 4),
            "drafted_tokens": done.drafted_tokens,
            "accepted_tokens": done.accepted_tokens,
        }

    def whole(self, done, prompt_tokens: int) -> dict:
        reason = _finish_reason(done.finish_reason)
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": reason,
            }
            if self.chat
            else {"index": 0, "text": done.text, "logprobs": None, "finish_reason": reason}
        )
        return {
            **self._envelope("chat.completion" if self.chat else "text_completion", [choice]),
            "usage": self.usage(done, prompt_tokens),
            "dflash": self._dflash(done),
        }

    def chunk(self, delta, done=None) -> dict:
        """One streamed piece; with `done` it is the last one, carrying the finish reason and the DFlash statistics."""
        reason = None if done is None else _finish_reason(done.finish_reason)
        choice = (
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            if self.chat
            else {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        )
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return out if done is None else {**out, "dflash": self._dflash(done)}

    def usage_chunk(self, done, prompt_tokens: int) -> dict:
        return {
            **self._envelope("chat.completion.chunk" if self.chat else "text_completion", []),
            "usage": self.usage(done, prompt_tokens),
        }
