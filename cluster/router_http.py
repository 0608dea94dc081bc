"""A router replica's own HTTP server (ServeConfig.ingress "routers", on http_port): OpenAI's API
(router/openai.py's `OpenAIServer`) answered in the router's process, so a call skips Serve's
HTTP proxy actor both ways, as cluster/router_grpc.py does for gRPC. With ingress "proxy"
Serve's HTTP proxy calls the same `OpenAIServer`.

The node's routers share the port (SO_REUSEPORT; the kernel spreads connections over them).
Paths are the proxy path's: below the app's route prefix (`{route_prefix}/v1/...`). A client
that disconnects cancels its handler (starlette's streaming response watches for it), which
closes the worker stream and frees the request's KV blocks, as on the proxy path.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

import uvicorn
from starlette.requests import Request
from starlette.responses import Response


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the replica's process is Ray's, and a stop comes
    from Serve (`stop`)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class RouterHttpServer:
    """`handler` (a starlette Request -> Response coroutine) served on host:port from `start`
    to `stop`."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]],
                 route_prefix: str = "/") -> None:
        self.handler = handler
        self.root_path = route_prefix.rstrip("/")
        self.num_calls = 0
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def app(self, scope, receive, send) -> None:  # ASGI
        if scope["type"] != "http":
            return
        self.num_calls += 1
        if self.root_path and scope["path"].startswith(self.root_path):
            scope = {**scope, "root_path": self.root_path}  # as Serve's proxy passes it
        response = await self.handler(Request(scope, receive))
        await response(scope, receive, send)

    async def start(self, host: str, port: int, grace_s: float = 30.0) -> None:
        """Raises OSError when the port cannot be bound."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise OSError(f"http_port: cannot listen on {host}:{port} ({e})") from None
        sock.listen(1024)
        config = uvicorn.Config(self.app, interface="asgi3", lifespan="off", proxy_headers=False,
                                log_level="warning",
                                access_log=False, timeout_graceful_shutdown=grace_s)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # it failed to start: its error
                self._task.result()
                raise OSError(f"http_port: the server on {host}:{port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Refuse new connections; let the calls in flight finish for up to the grace time."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
