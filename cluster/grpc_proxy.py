"""The gRPC servicer Serve's proxy registers (gRPCOptions.grpc_servicer_functions): mxserve's
service, with a guard that makes a client's cancel reach the replica on every path.

Serve's gRPC proxy cancels the replica's call only when the cancel lands while the proxy awaits
the next chunk. When it lands while grpc writes a chunk, grpc drops the handler's async generator
mid-stream, the generator is closed at its `yield`, and Serve's proxy catches the GeneratorExit
without cancelling: the router keeps decoding the abandoned request to its last token, holding
its KV blocks. The guard wraps each server-streaming handler; when it is closed at a yield it
resumes the proxy's generator and cancels that await, which is the path on which the proxy
cancels the call. The call itself is over by then, and grpc's context of a finished call must
not be touched (its peer() crashes the process), so the handler sees the call through
`CallContext`, which stops forwarding once the guard is closed. This module runs in the proxy's
process and imports only grpc's stubs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from mxserve.proto.mxserve_pb2_grpc import add_MxServeServicer_to_server


def add_servicer(servicer: Any, server: Any) -> None:
    """Register mxserve's service on `server`. On Serve's gRPCGenericServer (it replaces each
    method's handler with one its `service_handler_factory` makes) the server-streaming
    handlers are wrapped in `cancel_on_close`; on a plain grpc server this only registers."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        add_MxServeServicer_to_server(servicer, server)
        return

    def guarded_factory(service_method: str, streaming_type: Any) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if getattr(streaming_type, "name", "") == "UNARY_STREAM":
            return cancel_on_close(handler)
        return handler

    server.service_handler_factory = guarded_factory
    try:
        add_MxServeServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory


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
