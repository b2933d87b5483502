"""The OpenAI-compatible HTTP API over an `OnlineEngine` (FastAPI).

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events
when asked), GET /v1/models, /health, /version, /metrics (Prometheus), POST /tokenize
and /detokenize. Every request is checked before it reaches the engine; a bad one gets
an OpenAI-style JSON error with status 400 (401 without the API key). A client that
disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedmla.engine.online import OnlineEngine
from pagedmla.engine.outputs import StreamOutput
from pagedmla.engine.sampling_params import SamplingParams
from pagedmla.server.chat import ChatRenderer
from pagedmla.server.metrics import ServerMetrics
from pagedmla.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)
from pagedmla.version import package_version

# How often a request waiting for its first output checks that its client is still there.
_DISCONNECT_POLL_S = 0.5


class ApiError(Exception):
    """A request the server refuses: an OpenAI-style error body with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        kind = {400: "BadRequestError", 401: "AuthenticationError"}.get(self.status, "Error")
        return JSONResponse({"error": {"message": str(self), "type": kind, "param": self.param,
                                       "code": self.code or self.status}},
                            status_code=self.status)


@dataclass
class _Job:
    """One engine request of an HTTP request: prompt i of it, with n completions whose
    choices are numbered from `first_choice`."""

    request_id: int
    first_choice: int
    prompt_tokens: int
    n: int


class _Outputs:
    """The engine thread's outputs of an HTTP request's jobs, as an asyncio queue."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[StreamOutput] = asyncio.Queue()

    def __call__(self, out: StreamOutput) -> None:  # on the engine thread
        if not self.loop.is_closed():  # else the server has stopped: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


def build_app(engine: OnlineEngine, model_name: str, chat: ChatRenderer | None = None,
              api_key: str | None = None) -> FastAPI:
    """The API of `engine`'s model, served as `model_name`."""
    llm = engine.llm
    tokenizer = llm.tokenizer
    metrics = ServerMetrics(engine)
    app = FastAPI(title="pagedmla", version=package_version())
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return ApiError(f"{where}: {first.get('msg', 'invalid request')}", param=where
                        ).response()

    async def authorize(request: Request) -> None:
        """The API key check of the protected routes (a dependency: an HTTP middleware
        would hide a client's disconnect from the handlers)."""
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError("invalid or missing API key (Authorization: Bearer ...)",
                           status=401, code="invalid_api_key")

    protected = [Depends(authorize)]

    manager = llm.block_manager
    capacity = manager.num_usable_blocks * manager.block_size  # tokens the cache holds

    def render_chat(messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of the messages through the chat template (400 if it refuses)."""
        assert chat is not None and tokenizer is not None
        try:
            text = chat(messages, add_generation_prompt)
            return tokenizer.encode(text, add_special_tokens=False)
        except (ValueError, TypeError, UnicodeError) as error:
            raise ApiError(str(error), param="messages") from error

    def check_model(body: SamplingRequest) -> None:
        if body.model != model_name:
            raise ApiError(f"the model {body.model!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")
        field = body.unsupported()
        if field is not None:
            raise ApiError(f"{field} is not supported by this server", param=field)

    def submit(prompts: list[str | list[int]], params: SamplingParams, outputs: _Outputs
               ) -> list[_Job]:
        """Queue one engine request per prompt; a refused one aborts those queued."""
        jobs: list[_Job] = []
        try:
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    if tokenizer is None:
                        raise ApiError("this model has no tokenizer: send token ids",
                                       param="prompt")
                    prompt = tokenizer.encode(prompt)
                request_id = engine.add(prompt, params, outputs)
                jobs.append(_Job(request_id, i * params.n, len(prompt), params.n))
        except (ValueError, TypeError, UnicodeError, RuntimeError) as error:
            for job in jobs:
                engine.abort(job.request_id)
            status = 503 if isinstance(error, RuntimeError) else 400
            raise ApiError(str(error), status=status) from error
        metrics.prompt_tokens(sum(job.prompt_tokens for job in jobs))
        return jobs

    async def collect(jobs: list[_Job], outputs: _Outputs, request: Request
                      ) -> AsyncIterator[tuple[_Job, StreamOutput]]:
        """The jobs' outputs as they come, until every completion finished; a client
        that disconnects (or a cancelled response) aborts the jobs."""
        by_id = {job.request_id: job for job in jobs}
        arrived = polled = time.perf_counter()
        last: dict[tuple[int, int], float] = {}
        open_ = sum(job.n for job in jobs)
        try:
            while open_:
                try:
                    out = await asyncio.wait_for(outputs.queue.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    out = None
                now = time.perf_counter()
                if now - polled >= _DISCONNECT_POLL_S:
                    polled = now
                    if await request.is_disconnected():
                        return
                if out is None:
                    continue
                if out.token_ids:
                    key = (out.request_id, out.index)
                    metrics.tokens(len(out.token_ids), now - last.get(key, arrived),
                                   key not in last)
                    last[key] = now
                if out.finish_reason is not None:
                    open_ -= 1
                    metrics.finished(out.finish_reason, now - arrived)
                yield by_id[out.request_id], out
        finally:
            if open_:  # the client left (or the response was cancelled): abort the rest
                for job in jobs:
                    engine.abort(job.request_id)
                for _ in range(open_):
                    metrics.finished("abort", time.perf_counter() - arrived)

    def usage(jobs: list[_Job], completion_tokens: int) -> dict:
        prompt_tokens = sum(job.prompt_tokens for job in jobs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def token_bytes(text: str) -> list[int] | None:
        # A token that is part of a character decodes to U+FFFD: its bytes are unknown
        # here (the tokenizer protocol gives text only), and null says so.
        return None if "\ufffd" in text else list(text.encode())

    def completion_logprobs(out: StreamOutput, offset: int) -> dict:
        tokens = out.token_ids
        texts = [token_text(t) for t in tokens]
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts,
                "token_logprobs": [lp.get(t) for t, lp in zip(tokens, out.logprobs)],
                "top_logprobs": [{token_text(k): v for k, v in lp.items()}
                                 for lp in out.logprobs],
                "text_offset": offsets}

    def chat_logprobs(out: StreamOutput, top: int) -> dict:
        content = []
        for token, lp in zip(out.token_ids, out.logprobs):
            text = token_text(token)
            ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
            content.append({"token": text, "logprob": lp.get(token),
                            "bytes": token_bytes(text),
                            "top_logprobs": [{"token": token_text(k), "logprob": v,
                                              "bytes": token_bytes(token_text(k))}
                                             for k, v in ranked]})
        return {"content": content}

    def error_body(out: StreamOutput) -> dict:
        return {"error": {"message": out.error or "the request failed", "type": "InternalError",
                          "param": None, "code": 500}}

    def sse(data: dict | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

    @app.post("/v1/completions", dependencies=protected)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        prompts = body.prompts()
        if not prompts:
            raise ApiError("prompt is empty", param="prompt")
        try:
            params = body.sampling_params(body.max_tokens or 16, body.logprobs)
        except (ValueError, TypeError) as error:
            raise ApiError(str(error)) from error
        outputs = _Outputs()
        jobs = submit(prompts, params, outputs)
        rid, stamp = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": stamp, "model": model_name}
        echo = {i: (p if isinstance(p, str) else decode(p)) if body.echo else ""
                for i, p in enumerate(prompts)}

        if body.stream:
            async def events() -> AsyncIterator[str]:
                generated, offsets, started = 0, {}, set()
                async for job, out in collect(jobs, outputs, request):
                    if out.finish_reason == "error":
                        yield sse(error_body(out))
                        break
                    index = job.first_choice + out.index
                    text = out.text
                    if index not in started:
                        started.add(index)
                        text = echo[job.first_choice // job.n] + text
                    generated += len(out.token_ids)
                    if not (text or out.token_ids or out.finish_reason):
                        continue
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = completion_logprobs(out, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + len(out.text)
                    yield sse({**head, "choices": [{"index": index, "text": text,
                                                    "logprobs": logprobs,
                                                    "finish_reason": out.finish_reason}],
                               "usage": None})
                if body.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(jobs, generated)})
                yield sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        choices: dict[int, dict] = {}
        outs: dict[int, list[StreamOutput]] = {}
        async for job, out in collect(jobs, outputs, request):
            outs.setdefault(job.first_choice + out.index, []).append(out)
        failed = _failure(outs)
        if failed is not None:
            return JSONResponse(error_body(failed), status_code=500)
        for index, pieces in sorted(outs.items()):
            merged = _merge(pieces)
            choices[index] = {
                "index": index, "text": echo[index // params.n] + merged.text,
                "logprobs": (completion_logprobs(merged, 0) if body.logprobs is not None
                             else None),
                "finish_reason": merged.finish_reason}
        generated = sum(len(p.token_ids) for pieces in outs.values() for p in pieces)
        return JSONResponse({**head, "choices": list(choices.values()),
                             "usage": usage(jobs, generated)})

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body)
        if chat is None or tokenizer is None:
            raise ApiError("this model has no chat template: use /v1/completions",
                           param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = render_chat(messages, body.add_generation_prompt)
        # By default, as many tokens as the model's length and the whole cache allow.
        room = min(llm.max_model_len, capacity + 1) - len(ids)
        budget = body.token_budget or max(1, room)
        try:
            params = body.sampling_params(budget, body.num_logprobs)
        except (ValueError, TypeError) as error:
            raise ApiError(str(error)) from error
        outputs = _Outputs()
        jobs = submit([ids], params, outputs)
        rid, stamp = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": rid, "created": stamp, "model": model_name}
        top = body.top_logprobs or 0

        if body.stream:
            async def events() -> AsyncIterator[str]:
                generated = 0
                for index in range(params.n):
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [
                        {"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}], "usage": None})
                async for _, out in collect(jobs, outputs, request):
                    generated += len(out.token_ids)
                    if out.finish_reason == "error":
                        yield sse(error_body(out))
                        break
                    if not (out.text or out.finish_reason or (body.logprobs and out.token_ids)):
                        continue
                    delta = {"content": out.text} if out.text else {}
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [
                        {"index": out.index, "delta": delta,
                         "logprobs": chat_logprobs(out, top) if body.logprobs else None,
                         "finish_reason": out.finish_reason}], "usage": None})
                if body.include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                               "usage": usage(jobs, generated)})
                yield sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")

        outs: dict[int, list[StreamOutput]] = {}
        async for _, out in collect(jobs, outputs, request):
            outs.setdefault(out.index, []).append(out)
        failed = _failure(outs)
        if failed is not None:
            return JSONResponse(error_body(failed), status_code=500)
        choices = []
        for index, pieces in sorted(outs.items()):
            merged = _merge(pieces)
            choices.append({"index": index,
                            "message": {"role": "assistant", "content": merged.text},
                            "logprobs": chat_logprobs(merged, top) if body.logprobs else None,
                            "finish_reason": merged.finish_reason})
        generated = sum(len(p.token_ids) for pieces in outs.values() for p in pieces)
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": usage(jobs, generated)})

    @app.get("/v1/models", dependencies=protected)
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "pagedmla",
            "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"error": repr(engine.error)}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": package_version()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", dependencies=protected)
    async def tokenize(body: TokenizeRequest) -> dict:
        if tokenizer is None:
            raise ApiError("this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError("give either prompt or messages", param="prompt")
        if body.messages is not None:
            if chat is None:
                raise ApiError("this model has no chat template", param="messages")
            ids = render_chat([m.model_dump(exclude_none=True) for m in body.messages],
                              body.add_generation_prompt)
        else:
            try:
                ids = tokenizer.encode(body.prompt or "",
                                       add_special_tokens=body.add_special_tokens)
            except UnicodeError as error:
                raise ApiError(str(error), param="prompt") from error
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", dependencies=protected)
    async def detokenize(body: DetokenizeRequest) -> dict:
        if tokenizer is None:
            raise ApiError("this model has no tokenizer")
        vocab = llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(f"token ids must be in [0, {vocab}), got {bad[0]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


def _failure(outs: dict[int, list[StreamOutput]]) -> StreamOutput | None:
    """A completion's output that ended it with finish_reason "error", if any."""
    return next((p[-1] for p in outs.values() if p[-1].finish_reason == "error"), None)


def _merge(pieces: list[StreamOutput]) -> StreamOutput:
    """One completion's outputs as one."""
    last = pieces[-1]
    return StreamOutput(last.request_id, last.index,
                        [t for p in pieces for t in p.token_ids], "".join(p.text for p in pieces),
                        [lp for p in pieces for lp in p.logprobs], last.finish_reason, last.error)
