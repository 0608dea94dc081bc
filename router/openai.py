"""OpenAI's HTTP API on the router: POST /v1/chat/completions and /v1/completions (streamed as
server-sent events or not), GET /v1/models and /health.

Each body becomes the gRPC API's `pb.GenerateRequest` (router/openai_protocol.py) and goes
through `Router.generate`, so auth, admission, limits, routing and the workers are the gRPC
path's; only the framing differs. A request's first response is awaited before any byte goes
out, so a rejection (bad field, bad token, at capacity) is an HTTP status with OpenAI's error
body; an error after that ends the stream with an `error` event. A client that disconnects
ends the response (Serve's HTTP proxy cancels it), which closes its request streams then and
there, even one whose body never started: the workers abort the requests and free their KV
blocks, as for a gRPC cancel.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mxserve.api.errors import (
    DEADLINE_EXCEEDED,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    InvalidRequestError,
    ServeError,
    as_serve_error,
)
from mxserve.proto import mxserve_pb2 as pb
from mxserve.router.ingress import Router
from mxserve.router.openai_protocol import (
    CompletionLogprobs,
    Parsed,
    add_usage,
    chat_logprobs,
    parse_chat,
    parse_completion,
    usage,
)

# status code name -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP = {INVALID_ARGUMENT: (400, "invalid_request_error", None),
         UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
         NOT_FOUND: (404, "not_found_error", "model_not_found"),
         RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
         UNAVAILABLE: (503, "service_unavailable_error", None),
         DEADLINE_EXCEEDED: (504, "timeout_error", None),
         INTERNAL: (500, "server_error", None)}


def error_body(error: ServeError) -> tuple[int, dict]:
    status, kind, code = _HTTP.get(error.code, (500, "server_error", None))
    return status, {"error": {"message": error.message, "type": kind, "param": error.field,
                              "code": code}}


def error_response(error: ServeError) -> Response:
    status, body = error_body(error)
    headers = {}
    if error.retry_after_s is not None:  # the openai client waits as told before a retry
        headers = {"retry-after": str(math.ceil(error.retry_after_s)),
                   "retry-after-ms": str(round(error.retry_after_s * 1e3))}
    return _json(body, status, headers)


def _json(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(body), status, headers, media_type="application/json")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class OpenAIServer:
    """The HTTP handler: `await server(request)` -> a starlette Response."""

    def __init__(self, router: Router, max_body_bytes: int = 4 << 20) -> None:
        self.router = router
        self.max_body_bytes = max_body_bytes  # as the gRPC proxy's message cap
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    async def __call__(self, request: Request) -> Response:
        path = _path(request)
        metadata = list(request.headers.items())
        routes = {("POST", "/v1/chat/completions"): self.chat,
                  ("POST", "/v1/completions"): self.completions,
                  ("GET", "/v1/models"): self.models, ("GET", "/health"): self.health}
        handler = routes.get((request.method, path))
        if handler is None:
            known = any(p == path for _, p in routes)
            status = 405 if known else 404
            return _json({"error": {"message": f"{request.method} {path} is not served",
                                    "type": "invalid_request_error", "param": None,
                                    "code": None}}, status)
        try:
            return await handler(request, metadata)
        except Exception as e:
            error = as_serve_error(e)
            if error is None:
                raise
            return error_response(error)

    async def health(self, request: Request, metadata) -> Response:
        """200 while a worker reports in (no auth: a probe's)."""
        loads = await self.router.loads()
        return Response(status_code=200 if loads else 503)

    async def models(self, request: Request, metadata) -> Response:
        listed = await self.router.list_models(metadata)
        return _json({"object": "list", "data": [
            {"id": m.id, "object": "model", "created": self.created, "owned_by": "mxserve",
             "max_model_len": m.max_model_len} for m in listed.models]})

    async def _body(self, request: Request, metadata) -> dict:
        """The JSON body, after auth (a caller without a token learns nothing of its body)."""
        self.router.authenticate(metadata)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise _too_large(int(size), self.max_body_bytes)
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise _too_large(len(raw), self.max_body_bytes)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ServeError(INVALID_ARGUMENT, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ServeError(INVALID_ARGUMENT, "the body must be a JSON object")
        return body

    def _parsed(self, parse, *args) -> Parsed:
        try:
            parsed = parse(*args)
        except InvalidRequestError as e:
            raise ServeError.invalid(e) from None
        name = self.router.card.name
        if parsed.model and parsed.model != name:
            raise ServeError(NOT_FOUND, f"the model {parsed.model[:100]!r} does not exist; "
                                        f"this server serves {name!r}", "model")
        return parsed

    async def chat(self, request: Request, metadata) -> Response:
        parsed = self._parsed(parse_chat, await self._body(request, metadata))
        reply = ChatReply(self, parsed, f"chatcmpl-{uuid.uuid4().hex}")
        return await self._reply(parsed, reply, metadata)

    async def completions(self, request: Request, metadata) -> Response:
        parsed = self._parsed(parse_completion, await self._body(request, metadata),
                              self.router.limits.max_prompts)
        reply = CompletionReply(self, parsed, f"cmpl-{uuid.uuid4().hex}")
        return await self._reply(parsed, reply, metadata)

    async def _reply(self, parsed: Parsed, reply, metadata) -> Response:
        for i, r in enumerate(parsed.requests):
            r.request_id = reply.id if len(parsed.requests) == 1 else f"{reply.id}-{i}"
        streams = await _open(self.router, parsed.requests, metadata)
        if not parsed.stream:
            async for i, response in _merged(streams):
                reply.add(i, response)
            return _json(reply.body())
        return _EventStream(_events(reply, streams), streams)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.router.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 1 << 18:
                self._token_texts[token_id] = text
        return text


def _too_large(size: int, limit: int) -> ServeError:
    """400, not 429: a retry would not help (gRPC answers RESOURCE_EXHAUSTED, its code for it)."""
    return ServeError(INVALID_ARGUMENT, f"the body has {size} bytes; the limit is {limit}",
                      "body")


def _path(request: Request) -> str:
    """The path below the application's route prefix."""
    path, root = request.url.path, request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return "/" + path.strip("/")


Opened = list[tuple[pb.GenerateResponse, AsyncIterator[pb.GenerateResponse]]]


async def _open(router: Router, requests: Sequence[pb.GenerateRequest], metadata) -> Opened:
    """Start every request and wait for each one's first response; on any rejection the others
    are closed (their workers abort them) and it is raised."""
    streams = [router.generate(r, metadata) for r in requests]
    try:
        async with asyncio.TaskGroup() as group:
            firsts = [group.create_task(anext(s)) for s in streams]
    except BaseException as e:
        for s in streams:
            await s.aclose()
        if isinstance(e, BaseExceptionGroup):
            raise e.exceptions[0] from None
        raise
    return [(f.result(), s) for f, s in zip(firsts, streams)]


async def _merged(streams: Opened) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """Every stream's responses as they come, with the stream's index; closing this closes all
    of them."""
    if len(streams) == 1:
        (first, stream), = streams
        try:
            yield 0, first
            async for response in stream:
                yield 0, response
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, first, stream) -> None:
        try:
            await queue.put((i, first))
            async for response in stream:
                await queue.put((i, response))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, *s)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                num_open -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _EventStream(StreamingResponse):
    """The SSE response; however it ends, its request streams are closed at once (so the
    workers free the requests' KV blocks): a client gone before the first byte leaves the body
    iterator unstarted, and one gone while a chunk is being sent leaves it suspended."""

    def __init__(self, events: AsyncIterator[str], streams: Opened) -> None:
        super().__init__(events, media_type="text/event-stream")  # (body_iterator = events)
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            for _, stream in self._streams:
                await stream.aclose()


async def _events(reply, streams: Opened) -> AsyncIterator[str]:
    """The SSE stream: each response's chunk, the usage chunk when asked, then [DONE]; an error
    mid-stream is sent as an `error` event."""
    try:
        for chunk in reply.start():
            yield _sse(chunk)
        async for i, response in _merged(streams):
            chunk = reply.chunk(i, response)
            if chunk is not None:
                yield _sse(chunk)
        if reply.parsed.include_usage:
            yield _sse(reply.usage_chunk())
    except Exception as e:
        error = as_serve_error(e) or ServeError(INTERNAL, f"the stream failed: {e!r}")
        yield _sse(error_body(error)[1])
    yield "data: [DONE]\n\n"


class _Reply:
    """What one request's responses add up to: the final body, or the stream's chunks."""

    object: str = ""
    chunk_object: str = ""

    def __init__(self, server: OpenAIServer, parsed: Parsed, reply_id: str) -> None:
        self.server, self.parsed, self.id = server, parsed, reply_id
        self.model = server.router.card.name
        self.created = int(time.time())
        n = len(parsed.requests)
        self.texts = [""] * n
        self.finish: list[str | None] = [None] * n
        self.stop_reason: list[str | int | None] = [None] * n
        self.usage: dict | None = None

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _end(self, i: int, response: pb.GenerateResponse) -> None:
        if response.finish_reason:
            self.finish[i] = response.finish_reason
            kind = response.WhichOneof("stop_reason")
            self.stop_reason[i] = getattr(response, kind) if kind else None
            self.usage = add_usage(self.usage, usage(response.usage, self.parsed.drop_output))

    def usage_chunk(self) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": self.usage}

    def start(self) -> list[dict]:
        return []


class ChatReply(_Reply):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, server: OpenAIServer, parsed: Parsed, reply_id: str) -> None:
        super().__init__(server, parsed, reply_id)
        self.logprobs: list[dict] = []

    def _logprobs(self, response: pb.GenerateResponse) -> list[dict]:
        return chat_logprobs(response.logprobs, self.parsed.top_logprobs or 0,
                             self.server.token_text)

    def add(self, i: int, response: pb.GenerateResponse) -> None:
        self.texts[i] += response.text
        if self.parsed.top_logprobs is not None:
            self.logprobs += self._logprobs(response)
        self._end(i, response)

    def body(self) -> dict:
        logprobs = {"content": self.logprobs} if self.parsed.top_logprobs is not None else None
        return {**self._head(self.object), "choices": [{
            "index": 0, "message": {"role": "assistant", "content": self.texts[0]},
            "logprobs": logprobs, "finish_reason": self.finish[0],
            "stop_reason": self.stop_reason[0]}], "usage": self.usage}

    def start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def _chunk(self, delta: dict, logprobs, finish: str | None) -> dict:
        chunk = {**self._head(self.chunk_object), "choices": [{
            "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def chunk(self, i: int, response: pb.GenerateResponse) -> dict | None:
        self._end(i, response)
        if not response.text and not response.finish_reason and not response.logprobs:
            return None
        logprobs = None
        if self.parsed.top_logprobs is not None:
            logprobs = {"content": self._logprobs(response)}
        delta = {"content": response.text} if response.text else {}
        return self._chunk(delta, logprobs, response.finish_reason or None)


class CompletionReply(_Reply):
    object = chunk_object = "text_completion"

    def __init__(self, server: OpenAIServer, parsed: Parsed, reply_id: str) -> None:
        super().__init__(server, parsed, reply_id)
        top = parsed.top_logprobs
        self.logprobs = [CompletionLogprobs(top, server.token_text) if top is not None
                         else None for _ in parsed.requests]
        self.started = [False] * len(parsed.requests)
        self.whole: list[dict | None] = [None] * len(parsed.requests)  # non-streamed logprobs

    def _add(self, i: int, response: pb.GenerateResponse) -> tuple[str, dict | None]:
        """The text and logprobs this response adds to choice i (the echoed prompt first)."""
        text = ""
        logprobs = self.logprobs[i]
        if not self.started[i]:
            self.started[i] = True
            if self.parsed.echo:
                text = self._prompt_text(i)
                if logprobs is not None:
                    for lp in response.prompt_logprobs:
                        logprobs.add(lp)
        if not self.parsed.drop_output:
            text += response.text
            if logprobs is not None:
                for lp in response.logprobs:
                    logprobs.add(lp)
        self._end(i, response)
        return text, logprobs.take() if logprobs is not None else None

    def _prompt_text(self, i: int) -> str:
        text = self.parsed.prompts[i]
        if text is None:
            ids = self.parsed.requests[i].token_ids.ids
            text = self.server.router.tokenizer.decode(ids, skip_special_tokens=False)
        return text

    def add(self, i: int, response: pb.GenerateResponse) -> None:
        text, logprobs = self._add(i, response)
        self.texts[i] += text
        if logprobs is not None:
            whole = self.whole[i]
            if whole is None:
                self.whole[i] = logprobs
            else:
                for k, v in logprobs.items():
                    whole[k] += v

    def body(self) -> dict:
        return {**self._head(self.object), "choices": [{
            "index": i, "text": self.texts[i], "logprobs": self.whole[i],
            "finish_reason": self.finish[i], "stop_reason": self.stop_reason[i]}
            for i in range(len(self.texts))], "usage": self.usage}

    def chunk(self, i: int, response: pb.GenerateResponse) -> dict | None:
        text, logprobs = self._add(i, response)
        if not text and not response.finish_reason and not (logprobs and logprobs["tokens"]):
            return None
        chunk = {**self._head(self.chunk_object), "choices": [{
            "index": i, "text": text, "logprobs": logprobs,
            "finish_reason": response.finish_reason or None}]}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk
