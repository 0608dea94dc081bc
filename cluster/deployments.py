"""The Ray Serve application: a router ingress deployment (gRPC and OpenAI's HTTP API, served
by each router itself or through Serve's proxies: ServeConfig.ingress) in front of a worker
deployment, one engine per replica. Wiring only: the logic is
router/ingress.py (`Router`) and cluster/worker.py (`Worker`). The worker side is imported in
the worker replicas only, so a router replica's process loads no torch.

    client --gRPC--> RouterService (the router's own server) or Serve proxy -> RouterDeployment
        --> Router.generate --handle, stream--> WorkerDeployment
    (streaming.intake: --TCP--> the worker's IntakeServer, cluster/intake.py, no Serve call)
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator

import grpc
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from mxserve.api.errors import ServeError
from mxserve.api.outputs import ResumeState, encode_output
from mxserve.api.prefix_index import PrefixIndex
from mxserve.api.sampling_params import SamplingParams
from mxserve.cluster.config import ServeConfig
from mxserve.cluster.grpc_proxy import publish_admission
from mxserve.cluster.handles import DraftAddress, HandleWorkers, ReplicaDirectory
from mxserve.cluster.logs import GRPC_HOST_ENV, rss_bytes, setup_process
from mxserve.cluster.metrics import RayRouterMetrics, RoutingMetrics
from mxserve.cluster.output_channel import OutputReceiver
from mxserve.cluster.router_grpc import RouterGrpcServer
from mxserve.cluster.router_http import RouterHttpServer
from mxserve.proto import mxserve_pb2 as pb
from mxserve.router.ingress import Admission, Router, TokenAuth
from mxserve.router.openai import OpenAIServer
from mxserve.router.requests import ModelCard, RequestLimits

logger = logging.getLogger(__name__)
SERVICER = "mxserve.cluster.grpc_proxy.add_servicer"  # mxserve's service, cancels guarded
WORKER, ROUTER, DRAFT = "Worker", "Router", "Draft"
ROUTER_CLASS = "mxserve.cluster.request_router.PrefixAwareRequestRouter"
ROUND_ROBIN_CLASS = "mxserve.cluster.request_router.RoundRobinRequestRouter"
DRAFT_POLICY = "mxserve.cluster.autoscaling:DraftLoadPolicy"
WORKER_POLICY = "mxserve.cluster.autoscaling:InFlightPolicy"


# The router logs every request in one line (router/ingress.py), so Serve's access log is off.
_LOGGING = {"enable_access_log": False, "log_level": "WARNING"}  # mxserve logs at INFO


@serve.deployment(name=WORKER, logging_config=_LOGGING)
class WorkerDeployment:
    """One engine replica: token ids in and out (the router detokenizes)."""

    async def __init__(self, engine_options: dict, max_queued_requests: int,
                       index: dict | None = None, rank_options: dict | None = None,
                       drafts: DeploymentHandle | None = None,
                       kv_transfer: dict | None = None,
                       stall_timeout_s: float = 60.0, streaming: dict | None = None,
                       intake: bool = False) -> None:
        from mxserve.cluster.intake import IntakeServer
        from mxserve.cluster.kv_service import KVNode, TransferOptions
        from mxserve.cluster.metrics import WorkerMetricsExporter
        from mxserve.cluster.worker import Worker
        from mxserve.worker.config import EngineConfig
        from mxserve.worker.engine import build_engine
        from mxserve.worker.kv_events import KVEventPublisher, PublisherConfig
        from mxserve.worker.kv_transfer import measure_prefill_rate

        setup_process()
        replica_id = serve.get_replica_context().replica_id.unique_id
        config = EngineConfig(**engine_options)
        logger.info("worker %s: loading %s", replica_id, config.model or "SmolLM2-135M-Instruct")
        start = time.monotonic()
        self.launcher = None  # tensor-parallel: ranks 1..N-1 as actors in this placement group
        if config.tensor_parallel_size > 1:
            from mxserve.cluster.tp_ranks import RayRankLauncher

            self.launcher = RayRankLauncher(rank_options or {}, replica_id)
        draft_address, self._draft_refresh = None, None
        if drafts is not None:
            draft_address = DraftAddress(drafts, asyncio.get_running_loop())
            await draft_address.refresh()
            self._draft_refresh = asyncio.create_task(draft_address.keep_fresh())
        engine = await asyncio.to_thread(build_engine, config, self.launcher, draft_address)
        logger.info("worker %s: ready in %.1f s (%s, %s, %d KV blocks of %d tokens)", replica_id,
                    time.monotonic() - start, engine.runner.device,
                    str(engine.runner.dtype).removeprefix("torch."), engine.kv.num_blocks,
                    engine.kv.block_size)
        prefill_rate = None
        if kv_transfer is not None:  # the pull cost model's prefill rate, before serving
            kv_transfer = dict(kv_transfer)
            tokens = kv_transfer.pop("calibration_tokens")
            prefill_rate = kv_transfer.pop("prefill_tokens_per_s") or await asyncio.to_thread(
                measure_prefill_rate, engine, tokens)
        self.worker = Worker(engine, max_queued_requests, worker_id=replica_id,
                             node_id=ray.get_runtime_context().get_node_id(),
                             stall_timeout_s=stall_timeout_s, **(streaming or {}))
        self.worker.start(freeze_gc=True)  # this process serves this engine alone
        self.intake = None  # routers send requests over it (streaming.intake)
        if intake:
            self.intake = IntakeServer(self.worker)
            await self.intake.start(ray.util.get_node_ip_address())
        self.kv_node = None
        if kv_transfer is not None:
            self.kv_node = await KVNode.start(self.worker, TransferOptions(**kv_transfer),
                                              ray.util.get_node_ip_address(), prefill_rate)
            self.kv_node.service.on_drain = self.worker.drain
            logger.info("worker %s: KV transfer on %s (prefill %.0f tokens/s)", replica_id,
                        self.kv_node.address, prefill_rate)
        self.publisher = None
        if index is not None:  # publish this engine's prefix cache to the global index
            self.publisher = KVEventPublisher(
                PrefixIndex.from_url(index["url"], index["namespace"]), replica_id,
                self.worker.async_engine, PublisherConfig(**index["publisher"]))
            self.publisher.start()
        self._metrics = asyncio.create_task(WorkerMetricsExporter(self.worker).run())

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, kv_source: dict | None = None,
                       resume: ResumeState | None = None,
                       stream_to: dict | None = None) -> AsyncIterator[bytes]:
        """Each output as `encode_output` bytes (HandleWorkers decodes them). kv_source: a peer
        holding the prompt's prefix (the request router's or the router's); resume: go on from
        where a draining worker stopped (router/ingress.py); stream_to: the router's output
        channel, which then carries the engine's outputs (cluster/output_channel.py)."""
        async for out in self.worker.generate(prompt_token_ids, params, request_id, kv_source,
                                              resume, stream_to):
            yield encode_output(out)

    async def drain(self, worker_id: str | None = None) -> int | None:
        """Hand this worker's requests on to the others and take no more (`mxserve drain`,
        and the request routers when Serve stops this replica); None when worker_id names
        another replica (a handle reaches any one)."""
        if worker_id is not None and worker_id != self.worker.worker_id:
            return None
        return await self.worker.drain()

    async def audit(self) -> dict:
        """What this worker holds for requests (Worker.audit), for tests and operators."""
        return {**await self.worker.audit(), "replica_id": self.worker.worker_id}

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising (a failed engine, a stopped or
        wedged engine thread) gets the replica (and its tensor-parallel group) replaced."""
        self.worker.check_health()

    def group_node_ids(self) -> list[str]:
        """The nodes of this replica and of its other tensor-parallel ranks, in rank order."""
        ranks = self.launcher.node_ids() if self.launcher is not None else []
        return [ray.get_runtime_context().get_node_id(), *ranks]

    def record_routing_stats(self) -> dict:
        """Serve polls this for request routers; the router's Health RPC reads it too. With
        request intake, the routers poll it themselves (cluster/handles.ReplicaDirectory) and
        it carries what they need to route and connect."""
        load = self.worker.load()
        if self.intake is not None:
            engine = self.worker.engine
            load["intake"] = {**self.intake.target(), "model_id": engine.model_config.model_id,
                              "block_size": engine.kv.block_size,
                              "kv_address": self.kv_node.address if self.kv_node else None}
        return load

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metric (cluster/autoscaling.InFlightPolicy, used with
        request intake, whose requests Serve does not see): requests admitted, not finished."""
        return {"worker_in_flight": self.worker.num_in_flight}

    def draft_stats(self) -> dict | None:
        return self.worker.draft_stats()

    def record_replica_metadata(self) -> dict:
        """Read once by the request routers: how this worker hashes prompt blocks, and where
        its peers pull its KV blocks from (None: KV transfer off)."""
        engine = self.worker.engine
        return {"model_id": engine.model_config.model_id, "block_size": engine.kv.block_size,
                "kv_address": self.kv_node.address if self.kv_node else None}

    def kv_transfer_stats(self) -> dict | None:
        """Pulls made (by outcome, blocks, bytes) and served; None with KV transfer off."""
        if self.kv_node is None:
            return None
        return {"worker_id": self.worker.worker_id, "address": self.kv_node.address,
                "pulls": dict(self.kv_node.puller.counts),
                "migrated_out": self.worker.num_migrated_out,
                "resumed": self.worker.num_resumed,
                "served": dict(self.kv_node.service.counts)}

    def set_kv_faults(self, worker_id: str, faults: dict) -> bool:
        """Test hook: make worker_id's transfer service misbehave (kv_transfer.Exporter's
        faults); False when this replica is another worker (a handle reaches any one)."""
        if worker_id != self.worker.worker_id:
            return False
        self.kv_node.service.faults = dict(faults)
        return True

    async def __del__(self) -> None:  # Serve calls this when the replica stops
        if hasattr(self, "worker"):
            self._metrics.cancel()
            if self._draft_refresh is not None:
                self._draft_refresh.cancel()
            if self.publisher is not None:
                await self.publisher.close()
            intake = getattr(self, "intake", None)
            if self.kv_node is not None or intake is not None:
                # (Serve waits for no intake request: they are handed on here)
                await self.worker.drain()  # (a no-op once drained)
            if self.kv_node is not None:
                await self.kv_node.linger()  # peers may still pull what it handed on
                await self.kv_node.stop()
            if intake is not None:
                intake.close()
            self.worker.shutdown()


@serve.deployment(name=DRAFT, logging_config=_LOGGING)
class DraftDeployment:
    """A draft replica: the workers' EAGLE head (worker/draft_server.py) behind its socket
    (worker/draft_channel.py) on this node's address; workers ask a handle for `address` once
    and talk to it directly."""

    async def __init__(self, engine_options: dict, num_kv_blocks: int) -> None:
        from mxserve.worker.config import EngineConfig
        from mxserve.worker.draft_channel import DraftService
        from mxserve.worker.draft_server import DraftServer

        setup_process()
        config = EngineConfig(**engine_options)
        server = await asyncio.to_thread(DraftServer, config, num_kv_blocks)
        host = ray.util.get_node_ip_address()
        self.service = DraftService(server, host)
        logger.info("draft replica listening on %s (%d KV blocks)", self.service.address,
                    num_kv_blocks)

    def address(self) -> str:
        return self.service.address

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metric (cluster/autoscaling.py): the fraction of time
        since the last report the drafting thread was busy."""
        now, busy = time.monotonic(), self.service.busy_s
        last_time, last_busy = getattr(self, "_last_report", (now, busy))
        self._last_report = (now, busy)
        span = now - last_time
        return {"draft_busy": min(1.0, (busy - last_busy) / span) if span > 0 else 0.0}

    def stats(self) -> dict:
        return {"address": self.service.address, "node_id": ray.get_runtime_context().get_node_id(),
                **self.service.server.stats()}

    def check_health(self) -> None:
        self.service.check()

    def __del__(self) -> None:
        if hasattr(self, "service"):
            self.service.close()


@serve.deployment(name=ROUTER, logging_config=_LOGGING)
class RouterDeployment:
    """The ingress: gRPC (method names are the proto's RPC names) and OpenAI's HTTP API
    (`__call__`, router/openai.py), both on the same Router."""

    async def __init__(self, workers: DeploymentHandle, model: str | None, model_name: str,
                       max_model_len: int | None, app_name: str, limits: dict | None = None,
                       token_digests: list[str] | None = None, admission: dict | None = None,
                       migration_limit: int = 3, direct_streams: bool = False,
                       own_ports: dict | None = None, intake: dict | None = None) -> None:
        from mxserve.worker.model.loader import open_checkpoint

        setup_process()
        self.receiver = None  # direct streams: the workers' outputs come here, not over Serve
        if direct_streams:
            self.receiver = OutputReceiver()
            await self.receiver.start(ray.util.get_node_ip_address())
        checkpoint = await asyncio.to_thread(open_checkpoint, model)
        cfg = checkpoint.config
        card = ModelCard(model_name, max_model_len or cfg.max_position_embeddings,
                         cfg.vocab_size, tuple(cfg.eos_token_ids),
                         dict(checkpoint.generation_defaults))
        admission = Admission(**(admission or {}))

        async def publish(capacity: int | None) -> None:  # for the proxies' first shed
            await asyncio.to_thread(publish_admission, app_name, capacity,
                                    admission.retry_after_s)

        self.intake = None
        if intake is not None:  # requests over each worker's intake, routed here
            from mxserve.cluster.intake import IntakeWorkers
            from mxserve.router.routing import PrefixRouter, RoutingConfig

            index = (PrefixIndex.from_url(intake["redis_url"], intake["namespace"])
                     if intake["redis_url"] else None)
            routing_metrics = RoutingMetrics()
            self.intake = IntakeWorkers(
                self.receiver, ReplicaDirectory(app_name, WORKER),
                PrefixRouter(index, RoutingConfig(**intake["routing"]),
                             on_lookup=routing_metrics.on_lookup),
                intake["period_s"], routing_metrics.on_routed)
        self.router = Router(checkpoint.tokenizer, card,
                             self.intake or HandleWorkers(workers, app_name, WORKER,
                                                          self.receiver),
                             RayRouterMetrics(), RequestLimits(**(limits or {})),
                             TokenAuth(token_digests) if token_digests else None,
                             admission, publish, migration_limit)
        self.http = OpenAIServer(self.router)
        # ingress "routers": this replica's own servers (the node's routers share each port),
        # on the local cluster's host, else on every interface
        self.grpc_server = self.http_server = None
        if own_ports is not None:
            self.grace_s = own_ports["grace_s"]
            host = os.environ.get(GRPC_HOST_ENV) or "0.0.0.0"
            self.grpc_server = RouterGrpcServer(self.router, own_ports["timeout_s"])
            await self.grpc_server.start(host, own_ports["grpc"])
            self.http_server = RouterHttpServer(self.http, own_ports["route_prefix"])
            await self.http_server.start(host, own_ports["http"], self.grace_s)

    async def __call__(self, request: Request) -> Response:
        return await self.http(request)

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 (the RPC's name)
                       grpc_context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for response in self.router.generate(request,
                                                        grpc_context.invocation_metadata()):
                yield response
        except ServeError as e:
            _set_status(grpc_context, e)
            raise

    async def ListModels(self, request: pb.ListModelsRequest,  # noqa: N802
                         grpc_context) -> pb.ListModelsResponse:
        try:
            return await self.router.list_models(grpc_context.invocation_metadata())
        except ServeError as e:  # the status goes back; an exception would log a traceback
            _set_status(grpc_context, e)
            return pb.ListModelsResponse()

    async def Health(self, request: pb.HealthRequest, grpc_context) -> pb.HealthResponse:  # noqa: N802
        try:
            return await self.router.health(grpc_context.invocation_metadata())
        except ServeError as e:
            _set_status(grpc_context, e)
            return pb.HealthResponse()

    async def audit(self) -> dict:
        """What this router holds: requests in flight and shed, its capacity, its tasks and
        memory (the overload and cancel tests read it)."""
        return dict(replica_id=serve.get_replica_context().replica_id.unique_id,
                    in_flight=self.router.num_in_flight, shed=self.router.num_shed,
                    capacity=self.router.capacity, tasks=len(asyncio.all_tasks()),
                    rss_bytes=rss_bytes(), output_channel=None if self.receiver is None else
                    dict(connections=self.receiver.num_connections,
                         rejected=self.receiver.num_rejected, frames=self.receiver.num_frames),
                    router_grpc=None if self.grpc_server is None else
                    dict(calls=self.grpc_server.service.num_calls),
                    router_http=None if self.http_server is None else
                    dict(calls=self.http_server.num_calls),
                    intake=None if self.intake is None else dict(routed=self.intake.num_routed))

    async def __del__(self) -> None:  # Serve calls this when the replica stops
        # new calls go to the node's other routers; those in flight may finish (Serve counts
        # only its own proxies' calls when it drains a replica)
        if getattr(self, "grpc_server", None) is not None:
            await self.grpc_server.stop(self.grace_s)
        if getattr(self, "http_server", None) is not None:
            await self.http_server.stop()
        if hasattr(self, "router"):
            self.router.close()
        if getattr(self, "intake", None) is not None:
            self.intake.close()
        if getattr(self, "receiver", None) is not None:
            self.receiver.close_server()


def _set_status(grpc_context, error: ServeError) -> None:
    grpc_context.set_code(getattr(grpc.StatusCode, error.code))
    grpc_context.set_details(error.message)  # (the proxy reads a retry hint from it)


def app_builder(args: dict) -> serve.Application:
    """Serve's application builder (`import_path: mxserve.cluster.deployments:app_builder`, as
    a KubeRay RayService's serveConfigV2 names it, deploy/kuberay/): `args` are ServeConfig's
    fields; `ingress` defaults to "proxy" here, since serveConfigV2 starts Serve's proxies on
    the ports. The pods must carry cluster/local.py's SERVE_ENV."""
    return build_app(ServeConfig(**{"ingress": "proxy", **args}))


def _cluster_secret(app_name: str) -> str:
    """The app's KV transfer secret when the config gives none: drawn once and kept in the
    Ray cluster's internal KV store, so a redeploy reuses it (a new one would change the
    workers' arguments and restart every replica)."""
    from ray.experimental import internal_kv

    key = f"mxserve:kv_secret:{app_name}"
    if not ray.is_initialized():
        return secrets.token_hex(16)
    internal_kv._internal_kv_put(key, secrets.token_hex(16), overwrite=False)
    return internal_kv._internal_kv_get(key).decode()


def build_app(config: ServeConfig) -> serve.Application:
    """The application for `serve.run`: a router bound to the worker deployment."""
    engine = config.engine_config()
    engine_options = {**config.engine, "model": config.model}
    worker_options: dict = dict(
        ray_actor_options=config.worker_resources.ray_actor_options(),
        health_check_period_s=config.health_check_period_s,
        health_check_timeout_s=config.health_check_timeout_s,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        # Leave admission to the Worker (RESOURCE_EXHAUSTED), so let every request through.
        max_ongoing_requests=2 * (engine.max_num_seqs + config.max_queued_requests) + 1)
    if config.autoscaling is None:
        worker_options["num_replicas"] = config.num_workers
    else:
        a = config.autoscaling
        worker_options["autoscaling_config"] = dict(
            min_replicas=a.min_workers, max_replicas=a.max_workers,
            initial_replicas=a.initial_workers or max(a.min_workers, 1),
            target_ongoing_requests=a.target_ongoing_requests,
            upscale_delay_s=a.upscale_delay_s, downscale_delay_s=a.downscale_delay_s,
            look_back_period_s=a.look_back_period_s)
        if config.uses_intake:  # Serve sees no intake request: the workers report them
            worker_options["autoscaling_config"].update(
                metrics_interval_s=min(2.0, a.look_back_period_s / 2),
                policy=dict(policy_function=WORKER_POLICY,
                            policy_kwargs=dict(target=a.target_ongoing_requests)))
    index = None
    kv_transfer = None
    if config.kv_transfer.enabled:
        kv_transfer = config.kv_transfer.worker_options(_cluster_secret(config.app_name))
    if config.routing.policy == "round_robin":
        worker_options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUND_ROBIN_CLASS)
    if config.uses_prefix_index:
        worker_options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs=dict(redis_url=config.redis_url,
                                       namespace=config.index_namespace,
                                       kv_transfer=kv_transfer,
                                       **config.routing.policy_options()),
            request_routing_stats_period_s=config.routing.stats_period_s)
        index = dict(url=config.redis_url, namespace=config.index_namespace,
                     publisher=config.routing.publisher_options())
    rank_options = config.worker_resources.ray_actor_options()
    if engine.tensor_parallel_size > 1:  # the replica's bundle, then one for each other rank
        from mxserve.cluster.tp_ranks import rank_bundle

        worker_options["placement_group_bundles"] = \
            [rank_bundle(rank_options)] * engine.tensor_parallel_size
        worker_options["placement_group_strategy"] = \
            "STRICT_PACK" if config.worker_resources.num_gpus else "PACK"
    drafts = None
    if config.uses_draft_replicas:
        d = config.drafts
        scale: dict = {"num_replicas": d.num_replicas}
        if d.autoscaling is not None:
            a = d.autoscaling
            scale = {"autoscaling_config": dict(
                min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                initial_replicas=a.min_replicas, metrics_interval_s=a.metrics_interval_s,
                look_back_period_s=max(2 * a.metrics_interval_s, 4.0),
                upscale_delay_s=a.upscale_delay_s, downscale_delay_s=a.downscale_delay_s,
                policy=dict(policy_function=DRAFT_POLICY,
                            policy_kwargs=dict(target_busy=a.target_busy)))}
        drafts = DraftDeployment.options(
            ray_actor_options=d.resources.ray_actor_options(),
            health_check_period_s=config.health_check_period_s,
            health_check_timeout_s=config.health_check_timeout_s, **scale,
        ).bind(engine_options, d.num_kv_blocks)
    workers = WorkerDeployment.options(**worker_options).bind(
        engine_options, config.max_queued_requests, index, rank_options, drafts, kv_transfer,
        config.engine_stall_timeout_s,
        config.streaming.model_dump(exclude={"direct", "intake"}), config.uses_intake)
    return RouterDeployment.options(
        num_replicas=config.num_routers, max_ongoing_requests=10_000,
        ray_actor_options=config.router_resources.ray_actor_options(),
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
    ).bind(workers, config.model, config.served_model_name, engine.max_model_len,
           config.app_name, config.limits.request_limits(), config.token_digests(),
           dict(num_routers=config.num_routers, retry_after_s=config.limits.retry_after_s),
           config.migration_limit, config.streaming.direct,
           None if config.ingress == "proxy" else dict(
               grpc=config.grpc_port, http=config.http_port, route_prefix=config.route_prefix,
               timeout_s=config.request_timeout_s,
               grace_s=config.graceful_shutdown_timeout_s),
           dict(redis_url=config.redis_url if config.uses_prefix_index else None,
                namespace=config.index_namespace, routing=config.routing.policy_options(),
                period_s=config.routing.stats_period_s) if config.uses_intake else None)
