"""The gRPC servicer Serve's proxy registers (gRPCOptions.grpc_servicer_functions): mxserve's
service, with a guard that makes a client's cancel reach the replica on every path, and request
parsing that answers a malformed message INVALID_ARGUMENT in the proxy.

Malformed messages: grpc parses a request before any handler runs, and a parse failure (random
bytes, a string field holding invalid UTF-8) would end the call INTERNAL or UNKNOWN. Here a
failed parse yields a `MalformedRequest` instead, and the handler answers it INVALID_ARGUMENT
without forwarding it to a replica.

Serve's gRPC proxy cancels the replica's call only when the cancel lands while the proxy awaits
the next chunk. When it lands while grpc writes a chunk, grpc drops the handler's async generator
mid-stream, the generator is closed at its `yield`, and Serve's proxy catches the GeneratorExit
without cancelling: the router keeps decoding the abandoned request to its last token, holding
its KV blocks. The guard wraps each server-streaming handler; when it is closed at a yield it
resumes the proxy's generator and cancels that await, which is the path on which the proxy
cancels the call. The call itself is over by then, and grpc's context of a finished call must
not be touched (its peer() crashes the process), so the handler sees the call through
`CallContext`, which stops forwarding once the guard is closed. This module runs in the proxy's
process and imports only grpc's stubs (and cluster/logs.py: the proxy drops the tracebacks it
would log for client errors, on any cluster).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from mxserve.cluster.logs import install_client_error_filter
from mxserve.proto import mxserve_pb2 as pb

SERVICE = "mxserve.v1.MxServe"
# method -> (server streaming?, request type, response type), as proto/mxserve.proto declares
METHODS = {"Generate": (True, pb.GenerateRequest, pb.GenerateResponse),
           "ListModels": (False, pb.ListModelsRequest, pb.ListModelsResponse),
           "Health": (False, pb.HealthRequest, pb.HealthResponse)}


@dataclass(frozen=True)
class MalformedRequest:
    """What a request that failed to parse becomes (the handler answers INVALID_ARGUMENT)."""

    type_name: str
    num_bytes: int

    @property
    def message(self) -> str:
        return (f"request: {self.num_bytes} bytes that are not a valid {self.type_name} "
                "message (bad wire format, or a string field that is not UTF-8)")


def parse_or_malformed(message_type: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception:  # DecodeError, or a UTF-8 error from a string field
            return MalformedRequest(message_type.DESCRIPTOR.full_name, len(data))
    return parse


def add_servicer(servicer: Any, server: Any) -> None:
    """Register mxserve's service on `server`, requests parsed by `parse_or_malformed`. On
    Serve's gRPCGenericServer (it replaces each method's handler with one its
    `service_handler_factory` makes) every handler first answers a malformed request, and the
    server-streaming ones are wrapped in `cancel_on_close`; on a plain grpc server the
    servicer's methods are registered with the same parsing."""
    install_client_error_filter()  # (this runs in the proxy's process)
    handlers = {}
    for name, (streaming, request_type, response_type) in METHODS.items():
        if streaming:
            kind, method = grpc.unary_stream_rpc_method_handler, reject_malformed_stream
        else:
            kind, method = grpc.unary_unary_rpc_method_handler, reject_malformed
        handlers[name] = kind(method(getattr(servicer, name)),
                              request_deserializer=parse_or_malformed(request_type),
                              response_serializer=response_type.SerializeToString)
    factory = getattr(server, "service_handler_factory", None)
    if factory is not None:  # Serve's server: its factory's handlers replace the servicer's
        admission = ProxyAdmission(read_admission)

        def guarded_factory(service_method: str, streaming_type: Any) -> Callable:
            handler = factory(service_method=service_method, streaming_type=streaming_type)
            if getattr(streaming_type, "name", "") == "UNARY_STREAM":
                if service_method == f"/{SERVICE}/Generate":
                    handler = admission.wrap(handler)
                return cancel_on_close(reject_malformed_stream(handler))
            return reject_malformed(handler)

        server.service_handler_factory = guarded_factory
    try:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE,
                                                                              handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)
    finally:
        if factory is not None:
            server.service_handler_factory = factory


def reject_malformed(handler: Callable) -> Callable:
    """A unary handler that answers a MalformedRequest INVALID_ARGUMENT, else is `handler`
    (plus `add_retry_hint`)."""

    async def checked(request: Any, context: Any) -> Any:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        response = await handler(request, context)
        add_retry_hint(context)
        return response

    return checked


def reject_malformed_stream(handler: Callable[..., AsyncIterator]
                            ) -> Callable[..., AsyncIterator]:
    """`reject_malformed` for a server-streaming handler."""

    async def checked(request: Any, context: Any) -> AsyncIterator:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for message in handler(request, context):
            yield message
        add_retry_hint(context)

    return checked


# How the router's RESOURCE_EXHAUSTED details end when it knows when to retry (ingress.py).
_RETRY_AFTER = re.compile(r"retry after (\d+(?:\.\d+)?) s\)?$")


def add_retry_hint(context: Any) -> None:
    """A call that ended RESOURCE_EXHAUSTED with a retry time in its details gets it as
    `retry-after-ms` trailing metadata too. (Serve forwards a replica's status code and
    details but not its trailing metadata when the call fails, so it is set here, in the
    proxy.)"""
    code = getattr(context, "code", None)
    if code is None or code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return
    match = _RETRY_AFTER.search(context.details() or "")
    if match:
        context.set_trailing_metadata([("retry-after-ms",
                                        str(round(float(match.group(1)) * 1e3)))])


def cancel_on_close(handler: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
    """A server-streaming handler that forwards `handler`'s messages and, when closed before
    its end (GeneratorExit at a yield), delivers the close to `handler` as a CancelledError at
    its next await, so whatever it awaits (the replica's call) is cancelled too."""

    async def guarded(request: Any, context: Any) -> AsyncIterator:
        call = CallContext(context)
        inner = handler(request, call)
        finished = False
        try:
            async for message in inner:
                yield message
            finished = True
        finally:
            if not finished:
                call.close()
                await cancel_inner(inner)

    return guarded


class CallContext:
    """A grpc servicer context that forwards to the call's own until `close()`; after it, the
    peer and the request metadata answer as read at the start, and every other method is a
    no-op returning None (the call is gone: nothing can reach its client)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._open = True
        self._peer = context.peer()
        self._metadata = context.invocation_metadata()

    def close(self) -> None:
        self._open = False

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> Any:
        return self._metadata

    def __getattr__(self, name: str) -> Any:
        if self._open:
            return getattr(self._context, name)
        return _ignored


def _ignored(*args: Any, **kwargs: Any) -> None:
    return None


async def cancel_inner(inner: AsyncIterator) -> None:
    """Resume `inner` until it awaits, then cancel that await; messages it already holds are
    dropped (their client is gone). Returns once `inner` has ended."""
    while True:
        task = asyncio.ensure_future(inner.__anext__())
        await asyncio.sleep(0)  # one turn of the loop: it runs up to its first await
        if task.done():
            if task.cancelled() or task.exception() is not None:
                break  # StopAsyncIteration, or it failed: nothing more to cancel
            continue  # a message it had ready: dropped; resume it again
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        break
    aclose = getattr(inner, "aclose", None)
    if aclose is not None:
        await asyncio.gather(aclose(), return_exceptions=True)


# ---- the proxy's first-line admission --------------------------------------------------------

ADMISSION_KEY = "mxserve:admission:{app}"  # Ray internal KV: what each app's router publishes


def publish_admission(app: str, capacity: int | None, retry_after_s: float) -> None:
    """The router's side: the app's total capacity (None: no limit) for the proxies to read.
    A blocking call to Ray's GCS."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(ADMISSION_KEY.format(app=app), json.dumps(
        {"capacity": capacity, "retry_after_s": retry_after_s}), overwrite=True)


def read_admission(app: str) -> dict | None:
    """What the app's router last published, or None. A blocking call to Ray's GCS."""
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(ADMISSION_KEY.format(app=app))
    return json.loads(value) if value else None


class ProxyAdmission:
    """A cheap first shed, in the proxy: Generate calls to an app beyond its workers' total
    capacity (as its router publishes it) are answered RESOURCE_EXHAUSTED here, without the
    round trip to the router that a rejection there costs (a Serve handle call that ends in
    an exception: several times the CPU of the check). The router's own admission stays the
    exact one: a proxy counts only the calls it carries, so with several proxies the routers
    shed what gets past them. Calls without an `application` metadata entry are not counted.
    """

    def __init__(self, read: Callable[[str], dict | None], refresh_s: float = 1.0) -> None:
        self.read, self.refresh_s = read, refresh_s
        self.in_flight: dict[str, int] = {}
        self.limits: dict[str, dict] = {}
        self.num_shed = 0
        self._refresher: asyncio.Task | None = None

    def wrap(self, handler: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
        async def admitted(request: Any, context: Any) -> AsyncIterator:
            app = _application(context)
            why = self.enter(app) if app is not None else None
            if why is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why[0],
                                    (("retry-after-ms", str(round(why[1] * 1e3))),))
            try:
                async for message in handler(request, context):
                    yield message
            finally:
                if app is not None:
                    self.in_flight[app] -= 1

        return admitted

    def enter(self, app: str) -> tuple[str, float] | None:
        """Count a call to `app` in; or, past its capacity, the details to reject it with and
        when to retry."""
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.ensure_future(self._refresh())
        limit = self.limits.get(app) or {}
        capacity, num = limit.get("capacity"), self.in_flight.get(app, 0)
        if capacity is not None and num >= capacity:
            self.num_shed += 1
            after = limit.get("retry_after_s", 1.0)
            return (f"the server is at capacity ({num} requests in flight on this proxy, "
                    f"the workers' capacity {capacity}); retry after {after:g} s"), after
        self.in_flight[app] = num + 1
        return None

    async def _refresh(self) -> None:
        while True:
            for app in list(self.in_flight):
                try:
                    self.limits[app] = await asyncio.to_thread(self.read, app) or {}
                except Exception:  # the GCS briefly unreachable: keep the last limit
                    pass
            await asyncio.sleep(self.refresh_s)


def _application(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "application":
            return value
    return None
