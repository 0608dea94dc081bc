"""The router's logic, free of Ray and gRPC plumbing (the Serve deployment in
cluster/deployments.py only wires it): authenticate -> admit -> validate -> tokenize -> forward
to a worker -> detokenize and apply stop strings -> response messages.

Admission: the router knows its workers' capacity (their load reports, refreshed each
`Admission.refresh_s`) and admits at most its share of it; a request past that is rejected at
once, RESOURCE_EXHAUSTED with a retry hint, before any work is spent on it, so an overload is
shed here rather than queued on the workers.

Closing a `generate` stream early (client gone, deadline, a stop string seen here) closes the
worker stream, and the worker aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mxserve.api.errors import (
    INTERNAL,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    InvalidRequestError,
    ServeError,
    WorkerLostError,
    as_serve_error,
)
from mxserve.api.outputs import ResumeState, StepOutput
from mxserve.api.sampling_params import SamplingParams
from mxserve.api.stream import OutputStream
from mxserve.api.tokenizer import Tokenizer
from mxserve.proto import mxserve_pb2 as pb
from mxserve.router.requests import (
    ModelCard,
    RequestLimits,
    check_limits,
    prompt_token_ids,
    sampling_params,
)

logger = logging.getLogger(__name__)
# A request handed back this many times in a row without a token (every worker draining,
# waiting 0.05 s, 0.1 s, ... up to 5 s between: about a minute in all) fails UNAVAILABLE.
MAX_BOUNCES = 16
# A request's end line is INFO (finished, or ended by the client: router.errors.CLIENT_STATUSES)
# unless the server was short of capacity (WARNING) or at fault (ERROR).
_LOG_LEVELS = {RESOURCE_EXHAUSTED: logging.WARNING, UNAVAILABLE: logging.WARNING,
               INTERNAL: logging.ERROR, "error": logging.ERROR}
# Prompts longer than this are tokenized off the event loop (other streams keep flowing).
_TOKENIZE_INLINE_CHARS = 16_384


class Workers(Protocol):
    """How the router reaches the worker replicas (a Serve handle in the cluster)."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str, **hints) -> AsyncIterator[StepOutput]:
        """Stream the request's engine outputs; closing the stream aborts the request. Rejections
        raise ServeError (or anything `as_serve_error` understands). hints: `resume` (a
        ResumeState: go on from where a draining worker stopped, on another worker) and
        `kv_source` (where its blocks can be pulled from)."""

    async def loads(self) -> list[dict]:
        """Every worker's load report (`Worker.load()`)."""


class RouterMetrics(Protocol):
    def on_request_end(self, status: str, ttft_s: float | None, tpot_s: float | None,
                       num_output_tokens: int) -> None: ...


class NullMetrics:
    def on_request_end(self, status, ttft_s, tpot_s, num_output_tokens) -> None:
        pass


class TokenAuth:
    """Bearer-token auth on the API: a call carries `authorization: Bearer <token>` metadata
    (gRPC) or header (HTTP). Only the tokens' SHA-256 digests are held (several: rotation);
    nothing here logs a token or echoes one back."""

    def __init__(self, digests: Iterable[str]) -> None:
        self.digests = tuple(digests)
        if not self.digests:
            raise ValueError("TokenAuth needs at least one token digest")

    @staticmethod
    def digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def check(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        """Raise ServeError(UNAUTHENTICATED) unless `metadata` carries an accepted token."""
        values = [v for k, v in metadata if k.lower() == "authorization"]
        if not values:
            raise ServeError(UNAUTHENTICATED, "missing `authorization: Bearer <token>` "
                                              "metadata", "authorization")
        value = values[0].decode(errors="replace") if isinstance(values[0], bytes) \
            else values[0]
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ServeError(UNAUTHENTICATED, "authorization must be `Bearer <token>`",
                             "authorization")
        presented = self.digest(token.strip())
        if not any(hmac.compare_digest(presented, d) for d in self.digests):
            raise ServeError(UNAUTHENTICATED, "invalid token", "authorization")


@dataclass(frozen=True)
class Admission:
    """How much the router admits: its share (1 / num_routers) of the workers' capacity (each
    live, non-draining worker's `capacity` in its load report); more is rejected at once with
    RESOURCE_EXHAUSTED and a retry hint of retry_after_s. Until the first report, no limit."""

    num_routers: int = 1
    retry_after_s: float = 1.0
    refresh_s: float = 1.0  # how often the load reports are read
    loads_timeout_s: float = 2.0  # the longest a read may take


class Router:
    def __init__(self, tokenizer: Tokenizer, card: ModelCard, workers: Workers,
                 metrics: RouterMetrics | None = None, limits: RequestLimits | None = None,
                 auth: TokenAuth | None = None, admission: Admission | None = None,
                 publish: Callable[[int | None], Awaitable[None]] | None = None,
                 migration_limit: int = 3) -> None:
        """publish: called with the workers' total capacity when it changes (the cluster
        hands it to the gRPC proxies, which shed first: cluster/grpc_proxy.ProxyAdmission).
        migration_limit: times one request may go on elsewhere after losing its worker."""
        self.tokenizer = tokenizer
        self.card = card
        self.workers = workers
        self.metrics = metrics or NullMetrics()
        self.limits = limits or RequestLimits()
        self.auth = auth
        self.admission = admission or Admission()
        self.num_in_flight = 0  # requests admitted and not yet ended
        self.num_shed = 0  # requests rejected by admission
        self._refresher: asyncio.Task | None = None
        self.publish = publish
        self.total_capacity: int | None = None  # every worker's, as last read
        self._num_shed_unlogged, self._shed_logged_at = 0, -1.0
        self.migration_limit = migration_limit

    @property
    def capacity(self) -> int | None:
        """This router's share of the workers' capacity (None: no limit)."""
        if self.total_capacity is None:
            return None
        return math.ceil(self.total_capacity / self.admission.num_routers)

    def authenticate(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """ServeError(UNAUTHENTICATED) when auth is on and `metadata` lacks a valid token."""
        if self.auth is not None:
            self.auth.check(metadata)

    def prepare(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Validate and tokenize; raises ServeError(INVALID_ARGUMENT) naming the field."""
        self._check_limits(request)
        return self._tokenize(request)

    async def _prepare(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """`prepare`, the tokenizing in a thread when the prompt is long."""
        self._check_limits(request)  # cheap, on the loop
        size = len(request.text) + sum(len(m.content) for m in request.chat.messages)
        if size <= _TOKENIZE_INLINE_CHARS:
            return self._tokenize(request)
        return await asyncio.to_thread(self._tokenize, request)

    def _check_limits(self, request: pb.GenerateRequest) -> None:
        try:
            check_limits(request, self.limits, self.card)
        except InvalidRequestError as e:
            raise ServeError.invalid(e) from None

    def _tokenize(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        try:
            ids, _ = prompt_token_ids(request, self.tokenizer, self.card,
                                      self.limits.max_prompt_tokens)
            params = sampling_params(request.sampling_params, self.card.generation_defaults)
        except InvalidRequestError as e:
            raise ServeError.invalid(e) from None
        return ids, params

    def admit(self) -> None:
        """Count the request in, or raise ServeError(RESOURCE_EXHAUSTED) with a retry hint
        when this router holds its share of the workers' capacity already."""
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.create_task(self._refresh_capacity())
        if self.capacity is not None and self.num_in_flight >= self.capacity:
            self.num_shed += 1
            after = self.admission.retry_after_s
            raise ServeError(RESOURCE_EXHAUSTED,
                             f"the server is at capacity ({self.num_in_flight} requests in "
                             f"flight on this router, its limit "
                             f"{self.capacity}); retry after {after:g} s",
                             retry_after_s=after)
        self.num_in_flight += 1

    def set_capacity(self, loads: list[dict]) -> None:
        """This router's share of the capacity of the workers that take requests; None (no
        limit) when none does: a request then waits for one (a rolling update's new workers,
        a replaced one) as `_stream` does, rather than being shed."""
        total = sum(load.get("capacity", 0) for load in loads if not load.get("draining"))
        self.total_capacity = total or None

    async def _refresh_capacity(self) -> None:
        published = False
        while True:
            try:
                async with asyncio.timeout(self.admission.loads_timeout_s):
                    loads = await self.workers.loads()  # (Python 3.11's wait_for can lose a
                    # cancel that lands as the awaited call finishes: then this loop never ends)
                before = self.total_capacity
                self.set_capacity(loads)
                if self.publish is not None and (self.total_capacity != before
                                                 or not published):
                    await self.publish(self.total_capacity)
                    published = True
            except Exception as e:  # keep the last known capacity
                logger.warning("admission: worker load reports unavailable or unpublished "
                               "(%r); the capacity stays %s", e, self.capacity)
            await asyncio.sleep(self.admission.refresh_s)

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()

    async def generate(self, request: pb.GenerateRequest,
                       metadata: Sequence[tuple[str, str | bytes]] = ()
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the responses; raises ServeError for anything the client should see. Each
        request ends in one log line and one metrics record, however it ends. metadata: the
        call's (gRPC metadata, HTTP headers), for auth."""
        request_id = (request.request_id[:self.limits.max_request_id_chars]
                      or f"mx-{uuid.uuid4().hex}")
        end = RequestEnd(request_id, time.monotonic())
        admitted = False
        try:
            self.authenticate(metadata)
            end.shed = True
            self.admit()
            admitted, end.shed = True, False
            ids, params = await self._prepare(request)
            out = OutputStream(self.tokenizer, ids, params, self.card.eos_token_ids)
            # (closed with this stream, not when collected: the worker aborts at once)
            async with contextlib.aclosing(self._stream(request_id, ids, params, out,
                                                        end)) as responses:
                async for response in responses:
                    yield response
        except (asyncio.CancelledError, GeneratorExit):  # the client left, or its deadline
            if end.status == "error":  # (not after its last response: then it had finished)
                end.status = "cancelled"
            raise
        except Exception as e:
            error = as_serve_error(e)
            end.status, end.detail = (error.code, error.message) if error else ("error", repr(e))
            if error is None:
                raise
            if error.code == RESOURCE_EXHAUSTED and error.retry_after_s is None:
                # a worker's refusal (every worker full): retried as this router's own would be
                error.retry_after_s = self.admission.retry_after_s
            raise error from None
        finally:
            self.num_in_flight -= admitted
            self._record(end)

    async def _stream(self, request_id: str, ids: list[int], params: SamplingParams,
                      out: OutputStream, end: RequestEnd) -> AsyncIterator[pb.GenerateResponse]:
        """The worker's outputs as responses. A worker that drains hands the request back
        (finish_reason "migrate"): it is sent on, with its state, to another worker, which
        goes on from the next token; the client's stream stays open across the move. A worker
        lost mid-stream (WorkerLostError) is left the same way, up to `migration_limit` times:
        the next worker recomputes the prompt plus the tokens already sent and goes on from
        there, so the client sees each token once (greedy: exactly the undisturbed output)."""
        end.num_prompt_tokens = len(ids)
        hints: dict = {}
        num_bounces = 0  # hand-backs in a row with no token between (every worker draining)
        num_losses = 0  # workers lost under this request
        produced: list[int] = []  # every token id the workers sent, for a re-issue
        num_cached = 0
        while num_bounces <= MAX_BOUNCES:
            if num_bounces:  # wait for a worker that is not draining (a rolling update)
                await asyncio.sleep(min(0.05 * 2 ** (num_bounces - 1), 5.0))
            stream = self.workers.generate(ids, params, request_id, **hints)
            num_before = out.num_tokens
            try:
                async for step in stream:
                    produced += step.new_token_ids
                    num_cached = num_cached or step.num_cached_tokens
                    if step.finish_reason == "abort":
                        raise ServeError(UNAVAILABLE,
                                         f"request {request_id} was aborted by its worker")
                    moving = step.finish_reason == "migrate"
                    num_new = out.add(step.new_token_ids, None if moving else step.finish_reason)
                    if num_new or not moving:
                        end.first = end.first or time.monotonic()
                        end.num_tokens = out.num_tokens
                        yield _response(request_id, out, step, num_new, ids)
                    if out.finished:
                        end.status = out.finish_reason
                        return
                    if moving:
                        hints = _resume_hints(step.resume)
                        end.num_moves += 1
                        num_bounces = 0 if out.num_tokens > num_before else num_bounces + 1
                        break
                else:
                    raise ServeError(INTERNAL,
                                     f"request {request_id}: the worker stream ended early")
            except WorkerLostError as e:  # recompute elsewhere from the prompt + output so far
                num_losses += 1
                if num_losses > self.migration_limit:
                    raise ServeError(UNAVAILABLE, f"request {request_id}: {e}, its worker lost "
                                     f"{num_losses} times (migration_limit "
                                     f"{self.migration_limit}); retry later") from None
                logger.warning("request %s: %s; going on on another worker", request_id, e)
                hints = {"resume": ResumeState(e.worker_id, None, 0, list(produced), None,
                                               num_cached, worker_lost=True)}
                end.num_moves += 1
                num_bounces = 0 if out.num_tokens > num_before else num_bounces + 1
            finally:
                await stream.aclose()  # a no-op when the worker finished; else it aborts
        raise ServeError(UNAVAILABLE, f"request {request_id}: every worker is draining; retry "
                                      "later")

    async def list_models(self, metadata: Sequence[tuple[str, str | bytes]] = ()
                          ) -> pb.ListModelsResponse:
        self.authenticate(metadata)
        loads = await self.loads()
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=self.card.name, max_model_len=self.card.max_model_len,
            vocab_size=self.card.vocab_size, num_workers=len(loads))])

    async def health(self, metadata: Sequence[tuple[str, str | bytes]] = ()
                     ) -> pb.HealthResponse:
        self.authenticate(metadata)
        loads = await self.loads()
        return pb.HealthResponse(healthy=bool(loads),
                                 workers=[pb.WorkerLoad(**load) for load in loads])

    async def loads(self) -> list[dict]:
        """Every worker's load report, no auth (a health probe's); UNAVAILABLE when they do
        not come in time."""
        try:
            async with asyncio.timeout(self.admission.loads_timeout_s):
                return await self.workers.loads()
        except TimeoutError:
            raise ServeError(UNAVAILABLE, "the workers' load reports did not come in "
                                          f"{self.admission.loads_timeout_s:g} s") from None

    def _record(self, end: RequestEnd) -> None:
        now = time.monotonic()
        first, n = end.first, end.num_tokens
        ttft = first - end.start if first is not None else None
        tpot = (now - first) / (n - 1) if first is not None and n > 1 else None
        self.metrics.on_request_end(end.status.lower(), ttft, tpot, n)
        if end.shed:  # an overload: one line a second, not one a request
            self._num_shed_unlogged += 1
            if now - self._shed_logged_at >= 1.0:
                logger.warning("shed %d requests in %.1f s: %s", self._num_shed_unlogged,
                               now - self._shed_logged_at, end.detail)
                self._num_shed_unlogged, self._shed_logged_at = 0, now
            return
        detail = f": {end.detail}" if end.detail else ""
        if end.num_moves:
            detail += f" (moved {end.num_moves}x)"
        logger.log(_LOG_LEVELS.get(end.status, logging.INFO),
                   "request %s: %s%s (%d prompt + %d output tokens, %.0f ms)", end.request_id,
                   end.status, detail, end.num_prompt_tokens, n, (now - end.start) * 1e3)


@dataclass
class RequestEnd:
    """How a request ended, filled in as it runs: its log line and metrics record."""

    request_id: str
    start: float  # time.monotonic() at arrival
    status: str = "error"  # a finish reason, "cancelled", or a gRPC status name
    detail: str = ""  # the error's message
    first: float | None = None  # when its first token went out
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    num_moves: int = 0  # times a draining worker handed it on
    shed: bool = False  # rejected by admission (logged in a summary line a second)


def _resume_hints(state: ResumeState) -> dict:
    """Where a handed-back request goes on: its state, and its blocks' holder."""
    hints: dict = {"resume": state}
    if state.kv_address and state.num_blocks:
        hints["kv_source"] = {"address": state.kv_address, "num_blocks": state.num_blocks}
    return hints


def _response(request_id: str, out: OutputStream, step: StepOutput, num_new: int,
              prompt_ids: list[int]) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=request_id,
                                   token_ids=step.new_token_ids[:num_new], text=out.take_text())
    for lp in (step.new_logprobs or [])[:num_new]:
        response.logprobs.add(token_ids=list(lp), logprobs=list(lp.values()))
    if step.prompt_logprobs is not None:  # the worker sends them once, with the first token
        for token_id, lp in zip(prompt_ids, step.prompt_logprobs):
            if lp is None:  # the first prompt token: nothing precedes it
                response.prompt_logprobs.add(token_ids=[token_id])
            else:
                response.prompt_logprobs.add(token_ids=list(lp), logprobs=list(lp.values()))
    if out.finished:
        response.finish_reason = out.finish_reason
        response.usage.CopyFrom(pb.Usage(prompt_tokens=step.num_prompt_tokens,
                                         cached_tokens=step.num_cached_tokens,
                                         completion_tokens=out.num_tokens,
                                         num_drafts=step.num_drafts,
                                         draft_tokens=step.num_draft_tokens,
                                         accepted_draft_tokens=step.num_accepted_tokens))
        if isinstance(out.stop_reason, str):
            response.stop_string = out.stop_reason
        elif out.stop_reason is not None:
            response.stop_token_id = out.stop_reason
    return response
