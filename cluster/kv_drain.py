"""Asking a worker to drain over its KV transfer port (proto/kv_transfer.proto, Drain): what a
request router does when Serve stops a worker replica (cluster/request_router.py). Free of
torch, like everything a router replica imports."""

from __future__ import annotations

import logging

import grpc

from mxserve.proto import kv_transfer_pb2 as pb
from mxserve.proto import kv_transfer_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
SECRET_KEY = "x-mxserve-kv-secret"


def read_file(file: str | None) -> bytes | None:
    if file is None:
        return None
    with open(file, "rb") as f:
        return f.read()


def channel_to(address: str, options: dict, **grpc_options) -> grpc.aio.Channel:
    """A channel to a worker's transfer port, over TLS when the options name certificates."""
    extra = list(grpc_options.items())
    if options.get("tls_cert") or options.get("tls_ca"):
        credentials = grpc.ssl_channel_credentials(read_file(options.get("tls_ca")),
                                                   read_file(options.get("tls_key")),
                                                   read_file(options.get("tls_cert")))
        return grpc.aio.secure_channel(address, credentials, extra)
    return grpc.aio.insecure_channel(address, extra)


async def request_drain(address: str, options: dict, timeout_s: float = 10.0) -> int | None:
    """Ask the worker at `address` to hand its requests on; how many it did, None when it
    could not be reached (gone already: its streams failed, and the router re-issues them)."""
    async with channel_to(address, options) as channel:
        try:
            reply = await pb_grpc.KVTransferStub(channel).Drain(
                pb.DrainRequest(), metadata=((SECRET_KEY, options["secret"]),),
                timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            logger.warning("drain of the worker at %s failed: %s %s", address, e.code().name,
                           e.details())
            return None
    return reply.num_requests
