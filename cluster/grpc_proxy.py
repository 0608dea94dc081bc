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
        def guarded_factory(service_method: str, streaming_type: Any) -> Callable:
            handler = factory(service_method=service_method, streaming_type=streaming_type)
            if getattr(streaming_type, "name", "") == "UNARY_STREAM":
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
