"""A router replica's own gRPC server (ServeConfig.ingress "routers", on grpc_port): mxserve's
service answered in the router's process, so a call skips the hop through Serve's gRPC proxy
actor on its way in and every response's hop back out. With ingress "proxy" Serve's proxy
reaches the same `Router` through RouterDeployment.Generate.

Every router replica on a node listens on the same port (SO_REUSEPORT): the kernel spreads new
connections over them, so one address a node serves, as the proxy's does. A connection stays
with its router; a client's channel is one connection, so the spread is per channel, not per
call (clients that need a finer spread open several channels, as with any L4 balancer).

What the proxy path does and this keeps: a request that does not parse is answered
INVALID_ARGUMENT (cluster/grpc_proxy.parse_or_malformed), an overload's RESOURCE_EXHAUSTED
carries `retry-after-ms` trailing metadata, a client's cancel or deadline reaches the router's
stream however it lands (cancel_on_close), and ServeConfig.request_timeout_s bounds every call
(DEADLINE_EXCEEDED). Admission is the router's own, exact one (the proxy's first shed is not
needed: a rejection here is no extra hop). TLS is a terminating proxy's job in front of this
port, as for grpc_port (deploy/kuberay/tls-envoy.yaml).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from mxserve.api.errors import ServeError
from mxserve.cluster.grpc_proxy import add_retry_hint, add_servicer, cancel_on_close
from mxserve.proto import mxserve_pb2 as pb

MAX_MESSAGE_BYTES = 4 << 20  # as the proxy's (cluster/local.SERVE_ENV)


class RouterService:
    """mxserve's RPCs on a plain grpc.aio server, each a call of `router` (router/ingress.py)."""

    def __init__(self, router: Any, timeout_s: float | None = None) -> None:
        self.router, self.timeout_s = router, timeout_s
        self.num_calls = 0  # Generate calls taken
        self.Generate = cancel_on_close(self._generate)  # noqa: N803 (the RPC's name)

    async def _generate(self, request: pb.GenerateRequest, context: Any
                        ) -> AsyncIterator[pb.GenerateResponse]:
        self.num_calls += 1
        stream = self.router.generate(request, context.invocation_metadata())
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    if deadline is None:
                        response = await anext(stream)
                    else:
                        response = await asyncio.wait_for(
                            anext(stream), max(0.0, deadline - time.monotonic()))
                except StopAsyncIteration:
                    return
                yield response
        except ServeError as e:
            await abort(context, e)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request took longer than the server's "
                                f"request_timeout_s ({self.timeout_s:g} s)")
        finally:
            await stream.aclose()

    async def ListModels(self, request: pb.ListModelsRequest,  # noqa: N802
                         context: Any) -> pb.ListModelsResponse:
        try:
            return await self.router.list_models(context.invocation_metadata())
        except ServeError as e:
            await abort(context, e)

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:  # noqa: N802
        try:
            return await self.router.health(context.invocation_metadata())
        except ServeError as e:
            await abort(context, e)


async def abort(context: Any, error: ServeError) -> None:
    """End the call with `error`'s status; an overload's retry time goes as trailing metadata
    too, as the proxy path sends it."""
    context.set_code(getattr(grpc.StatusCode, error.code))
    context.set_details(error.message)
    add_retry_hint(context)
    await context.abort(getattr(grpc.StatusCode, error.code), error.message)


class RouterGrpcServer:
    """`router` served on host:port (shared with the other routers of the node) from `start` to
    `stop`."""

    def __init__(self, router: Any, timeout_s: float | None = None) -> None:
        self.service = RouterService(router, timeout_s)
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        add_servicer(self.service, self.server)

    async def start(self, host: str, port: int) -> None:
        """Raises OSError when the port cannot be bound."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError:  # (grpc raises where older versions returned 0)
            bound = 0
        if bound == 0:
            raise OSError(f"grpc_port: cannot listen on {address}")
        await self.server.start()

    async def stop(self, grace_s: float | None) -> None:
        """Refuse new calls; let those in flight finish for up to grace_s."""
        await self.server.stop(grace_s)
