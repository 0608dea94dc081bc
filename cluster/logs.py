"""What the serving processes log, and where the gRPC proxy listens.

A request the client got wrong or gave up on (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
DEADLINE_EXCEEDED, a cancel) is not a fault of the server: the router logs it in one line
(router/ingress.py), and the tracebacks Ray Serve's proxy, its replicas and asyncio would print for
it are dropped by `ClientErrorFilter`. Anything else keeps Serve's logging.

`setup_process` runs in every process of the embedded local cluster (Ray's
worker_process_setup_hook, cluster/local.py): it installs the filter and sends mxserve's own log
records through Serve's handlers; with MXSERVE_GRPC_HOST set it also makes the gRPC proxy listen
on that host instead of on every interface. Serve replicas of any cluster call it too
(cluster/deployments.py), so their logs read the same under KubeRay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

# gRPC status names of requests the client got wrong or ended itself.
CLIENT_ERROR_CODES = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
                                "CANCELLED", "UNAUTHENTICATED", "NOT_FOUND", "OUT_OF_RANGE"})
GRPC_HOST_ENV = "MXSERVE_GRPC_HOST"


def client_error_code(error: BaseException | None) -> str | None:
    """The gRPC status name when `error` (or an error it wraps) ends a request the client got
    wrong or cancelled; None for a fault of the server."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, asyncio.CancelledError) or type(error).__name__ in (
                "RequestCancelledError", "TaskCancelledError"):
            return "CANCELLED"
        code = getattr(error, "code", None)  # router.errors.ServeError: a status name
        if isinstance(code, str) and code in CLIENT_ERROR_CODES:
            return code
        grpc_code = getattr(error, "grpc_code", None)  # Serve's gRPCStatusError
        if grpc_code is not None and getattr(grpc_code, "name", None) in CLIENT_ERROR_CODES:
            return grpc_code.name
        error = (getattr(error, "original_exception", None) or getattr(error, "cause", None)
                 or error.__cause__ or error.__context__)
    return None


class ClientErrorFilter(logging.Filter):
    """Drops a log record whose exception is a client error (see `client_error_code`), and the
    proxy's note that it cancels a request (the router logs the cancel)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if client_error_code(error) is not None:
            return False
        return not (record.levelno < logging.WARNING
                    and str(record.msg).startswith("Cancelling request"))


_FILTERED_LOGGERS = ("ray.serve", "asyncio")


def install_client_error_filter() -> None:
    """`ClientErrorFilter` on Serve's and asyncio's loggers in this process (idempotent)."""
    for name in _FILTERED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ClientErrorFilter) for f in logger.filters):
            logger.addFilter(ClientErrorFilter())


def setup_process() -> None:
    """Install the filter and mxserve's log routing in this process (idempotent)."""
    install_client_error_filter()
    mx, serve_logger = logging.getLogger("mxserve"), logging.getLogger("ray.serve")
    if serve_logger.handlers and not mx.handlers:
        for handler in serve_logger.handlers:
            mx.addHandler(handler)
        mx.setLevel(logging.INFO)
        mx.propagate = False
    host = os.environ.get(GRPC_HOST_ENV)
    if host:
        _bind_grpc_proxy(host)


def _bind_grpc_proxy(host: str) -> None:
    """Serve's gRPC proxy listens on [::]:port; this makes it listen on host:port. Serve adds the
    address through default_impl.add_grpc_address, which is there to be replaced."""
    from ray.serve._private import default_impl

    add = default_impl.add_grpc_address
    if getattr(add, "mxserve_host", None) == host:
        return

    def add_grpc_address(server, address: str) -> None:
        add(server, f"{host}:{address.rsplit(':', 1)[1]}")

    add_grpc_address.mxserve_host = host
    default_impl.add_grpc_address = add_grpc_address


def stat_cpu_s(path: str) -> tuple[str, float] | None:
    """(the kernel's name, CPU seconds user + system) from a Linux /proc stat file (a process's
    or a thread's), or None where it cannot be read (it ended meanwhile)."""
    try:
        with open(path) as f:
            comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        fields = rest.split()
        return comm, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread of this process (Linux /proc), by its
    Python thread name, or "os:" + the kernel's name for threads Python did not start (Ray's
    own); threads of one name summed. Which thread of a replica keeps the GIL from its engine
    thread shows here. Empty where /proc cannot be read."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        stat = stat_cpu_s(f"/proc/self/task/{tid}/stat")
        if stat is not None:
            name = names.get(int(tid)) or "os:" + stat[0]
            out[name] = out.get(name, 0.0) + stat[1]
    return out


def rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
