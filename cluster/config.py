"""The serving cluster's configuration: what `mxserve serve` reads (flags or a YAML/JSON file).

Pydantic, because users and deploy files supply these values (STYLE.md 7). Engine options are
EngineConfig's own (worker/config.py) and are checked by building one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from mxserve.cluster.client import API_KEY_ENV
from mxserve.worker.config import EngineConfig

SMOLLM2_NAME = "SmolLM2-135M-Instruct"


class Resources(BaseModel):
    """Ray resources one replica reserves. `resources` are custom ones, e.g. {"worker_node": 1}
    to pin replicas onto nodes started with that resource."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)

    def ray_actor_options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "resources": dict(self.resources)}


class Autoscaling(BaseModel):
    """Ray Serve autoscaling of the workers by ongoing requests per replica."""

    model_config = ConfigDict(extra="forbid")
    min_workers: int = Field(1, ge=0)
    max_workers: int = Field(1, ge=1)
    initial_workers: int | None = Field(None, ge=1)  # at deploy; None: min_workers (at least 1)
    target_ongoing_requests: float = Field(16.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)  # load must stay high this long to add a worker
    downscale_delay_s: float = Field(600.0, ge=0)  # and low this long to remove one
    look_back_period_s: float = Field(30.0, gt=0)  # window the load is averaged over

    @model_validator(mode="after")
    def _check(self) -> Autoscaling:
        if self.max_workers < self.min_workers:
            raise ValueError("autoscaling.max_workers must be >= min_workers")
        if self.initial_workers is not None and not \
                self.min_workers <= self.initial_workers <= self.max_workers:
            raise ValueError("autoscaling.initial_workers must be within min_workers .. "
                             "max_workers")
        return self


class Drafts(BaseModel):
    """The draft replicas that serve the workers' EAGLE head when the engine's
    speculative_config has draft_placement "replica" (worker/draft_server.py): how many, what
    each reserves (its own GPU, a fraction of the workers', or CPU only), and its KV pool."""

    model_config = ConfigDict(extra="forbid")
    num_replicas: int = Field(1, ge=1)
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=1.0))
    num_kv_blocks: int = Field(4096, ge=16)  # the head's pool, in the workers' block size
    autoscaling: DraftAutoscaling | None = None  # when set, replaces num_replicas


class DraftAutoscaling(BaseModel):
    """Draft replicas scaled on their own load (cluster/autoscaling.py): enough to keep each
    one's drafting thread busy about target_busy of the time."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_busy: float = Field(0.6, gt=0, le=1)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    metrics_interval_s: float = Field(2.0, gt=0)  # how often replicas report their load

    @model_validator(mode="after")
    def _check(self) -> DraftAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("drafts.autoscaling.max_replicas must be >= min_replicas")
        return self


class Routing(BaseModel):
    """How the router picks a worker. "prefix" (router/routing.py): longest cached prefix per
    the global prefix index in Redis, minus a load penalty. "power_of_two": Ray Serve's default,
    the less loaded of two random workers. "round_robin": in turn (a baseline)."""

    model_config = ConfigDict(extra="forbid")
    policy: Literal["prefix", "power_of_two", "round_robin"] = "prefix"
    prefix_weight: float = Field(1.0, ge=0)  # score per cached prompt token
    load_weight: float = Field(1.0, ge=0)  # score lost per token of work queued on the worker
    request_tokens: float = Field(64.0, ge=0)  # a running/waiting request's work, in tokens
    kv_weight: float = Field(256.0, ge=0)  # score lost at a full KV pool
    cache_weight: float = Field(32.0, ge=0)  # score lost by the worker caching the most blocks
    lookup_timeout_s: float = Field(0.05, gt=0)  # slower index lookups fall back to load only
    retry_after_s: float = Field(1.0, ge=0)  # after an index failure, load only this long
    recent_ttl_s: float = Field(10.0, ge=0)  # routed prompts' blocks count as held this long
    stats_period_s: float = Field(0.5, gt=0)  # how often Serve polls each worker's load
    heartbeat_s: float = Field(1.0, gt=0)  # worker heartbeat in the index
    heartbeat_ttl_s: float = Field(5.0, gt=0)  # a worker silent this long is purged

    def policy_options(self) -> dict:
        return self.model_dump(include={"prefix_weight", "load_weight", "request_tokens",
                                        "kv_weight", "cache_weight", "lookup_timeout_s",
                                        "retry_after_s", "recent_ttl_s"})

    def publisher_options(self) -> dict:
        return self.model_dump(include={"heartbeat_s", "heartbeat_ttl_s"})


class KVTransfer(BaseModel):
    """KV blocks between workers over gRPC (cluster/kv_service.py): a worker that routing
    chose for load pulls a prompt's cached prefix from the worker holding it when that is
    faster than computing it. Each worker serves its blocks on a port of its own; only callers
    with the app's shared secret get in (drawn for each deployment unless given), over TLS
    when tls_cert and tls_key are given (tls_ca: mutual TLS, every worker's certificate signed
    by it)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    secret: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    chunk_bytes: int = Field(2 << 20, ge=4096, le=8 << 20)  # payload per message
    max_blocks: int = Field(8192, ge=1)  # blocks one pull may ask for
    min_pull_blocks: int = Field(2, ge=1)  # fewer missing blocks are computed, not pulled
    timeout_s: float = Field(30.0, gt=0)  # the longest a pull may take
    # parallel streams of one pull; None: one for every 4 cores the worker's process may run
    # on, 1 to 4 (each stream keeps a thread busy on both ends for the whole transfer: on a
    # small host more streams only take turns at the cores and the GIL)
    num_streams: int | None = Field(None, ge=1, le=16)
    calibration_tokens: int = Field(512, ge=16)  # the start-up prefill the cost model times
    # the prefill rate the cost model assumes instead of timing one at start-up (tokens/s)
    prefill_tokens_per_s: float | None = Field(None, gt=0)
    # what this worker's pulls ask for: "raw" (the cache's bytes) or MX-compressed payloads
    # ("mxfp8": 8 bits a value, "mxfp6": 6, plus a scale per 32) for slow links; MX changes
    # the pulled KV's numbers (bench/results/kv_transfer_mx.md gives the effect)
    encoding: Literal["raw", "mxfp8", "mxfp6"] = "raw"
    # the checksum this worker's exports send: "auto" sums a GPU pool's raw payloads on the GPU
    # (WSUM64, kernels/checksum.py) and hashes everything else on the host (XXH3-64); "wsum64"
    # or "xxh3" for every raw payload (MX payloads always take XXH3-64)
    checksum: Literal["auto", "xxh3", "wsum64"] = "auto"
    # how this worker's pulls take the chunks: "socket" (a TCP connection to the holder's
    # data port, opened by a one-time ticket from the gRPC call; a host pool's blocks go from
    # cache to cache with no copy in Python) or "grpc" (in the call's messages). Holders with
    # TLS configured serve no socket: their pulls stream over gRPC whatever is asked
    data_plane: Literal["socket", "grpc"] = "socket"

    @model_validator(mode="after")
    def _check(self) -> KVTransfer:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("kv_transfer: give tls_cert and tls_key together")
        return self

    def worker_options(self, default_secret: str) -> dict:
        """What each worker replica gets (and the request routers, which ask workers Serve
        is stopping to drain): the secret is default_secret unless one is set."""
        options = self.model_dump(exclude={"enabled"})
        options["secret"] = self.secret or default_secret
        return options


class Streaming(BaseModel):
    """How a worker packs a stream's tokens into messages under load (cluster/worker.py): one
    more token a message for every `streams_per_token` streams running, up to
    `max_tokens_per_message` (1: every token its own message). A lone stream always gets each
    token at once. direct: the messages go from each worker's engine thread to the router over
    one TCP connection a (worker, router) pair, a frame a step, instead of as Serve stream
    messages (cluster/output_channel.py); on unless set off, or unless kv_transfer.tls_cert
    asks for encrypted traffic between nodes (the channel is plain TCP)."""

    model_config = ConfigDict(extra="forbid")
    streams_per_token: int = Field(8, ge=1)
    max_tokens_per_message: int = Field(16, ge=1)
    direct: bool = True
    # intake: the routers send each request to the worker they choose over one TCP connection
    # a (router, worker) pair, routing it themselves, not as a Serve call each
    # (cluster/intake.py); needs direct and the prefix routing policy. None: on where those
    # hold (ServeConfig.uses_intake)
    intake: bool | None = None


class Limits(BaseModel):
    """Caps on one request, enforced by the router (INVALID_ARGUMENT naming the field; see
    router/requests.RequestLimits), and the retry hint an overload's RESOURCE_EXHAUSTED
    carries (`retry-after-ms` trailing metadata)."""

    model_config = ConfigDict(extra="forbid")
    max_prompt_tokens: int | None = Field(None, ge=1)  # None: up to the context length
    max_prompt_chars: int | None = Field(None, ge=1)  # None: 32 per token of context
    max_chat_messages: int = Field(1024, ge=1)
    max_stop_strings: int = Field(64, ge=0)
    max_stop_chars: int = Field(1024, ge=1)
    max_stop_token_ids: int = Field(1024, ge=0)
    max_request_id_chars: int = Field(256, ge=1)
    max_prompts: int = Field(64, ge=1)  # prompts in one /v1/completions request
    retry_after_s: float = Field(1.0, ge=0)

    def request_limits(self) -> dict:
        return self.model_dump(exclude={"retry_after_s"})


class ServeConfig(BaseModel):
    """One served model: a router ingress deployment in front of `num_workers` worker replicas."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # HF directory or .gguf path; None: SmolLM2-135M-Instruct
    model_name: str | None = None  # the name clients pass; None: derived from `model`
    engine: dict[str, Any] = Field(default_factory=dict)  # EngineConfig options (no `model`)
    num_workers: int = Field(1, ge=1)
    autoscaling: Autoscaling | None = None  # when set, replaces num_workers
    worker_resources: Resources = Field(default_factory=Resources)
    router_resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.5))
    num_routers: int = Field(1, ge=1)
    max_queued_requests: int = Field(64, ge=0)  # per worker, beyond max_num_seqs running
    # The local cluster's routers (or proxies) listen on `host` (loopback unless exposed on
    # purpose, e.g. "0.0.0.0"); on an existing Ray cluster they listen on every interface.
    host: str = "127.0.0.1"
    grpc_port: int = Field(9000, ge=1, le=65535)
    http_port: int = Field(8000, ge=1, le=65535)  # OpenAI's HTTP API
    metrics_port: int = Field(8080, ge=1, le=65535)  # Ray's Prometheus export (local cluster)
    # Who answers grpc_port and http_port. "routers": every router replica serves both itself
    # (cluster/router_grpc.py, cluster/router_http.py; a node's routers share each port, the
    # kernel spreading connections over them) and Serve starts no proxy: nothing between a
    # client and its router. "proxy": Ray Serve's gRPC and HTTP proxy actors (`proxy_location`),
    # which pick one of several apps on one cluster by the `application` metadata or the route
    # prefix; a RayService's serveConfigV2 starts them, so its app builder defaults to this.
    ingress: Literal["routers", "proxy"] = "routers"
    proxy_location: Literal["HeadOnly", "EveryNode"] = "EveryNode"  # with ingress "proxy"
    request_timeout_s: float | None = Field(None, gt=0)  # server-side deadline for every call
    # How often Serve asks each worker whether it can still serve (a failed tensor-parallel
    # rank, a dead engine thread); a worker that cannot is replaced.
    health_check_period_s: float = Field(10.0, gt=0)
    # A worker whose health check has not answered in this long is replaced too (a process
    # stopped, or an event loop blocked): its streams then go on on the others.
    health_check_timeout_s: float = Field(30.0, gt=0)
    # A worker whose engine has work but finished no step for this long fails its health
    # check (a wedged engine: a hung kernel, a deadlock), so Serve replaces it. Above the
    # longest step a worker may take (a long prompt's prefill chunk on a slow device).
    engine_stall_timeout_s: float = Field(60.0, gt=0)
    # How many times one request may go on on another worker after its worker died or stopped
    # answering mid-stream (router/ingress.py) before it fails UNAVAILABLE.
    migration_limit: int = Field(3, ge=0)
    # How long Serve lets a replica it stops (a redeploy, a scale-down) finish its requests
    # before killing it: a router's client streams; a worker's, unless KV transfer is on (it
    # then hands them to the other workers at once).
    graceful_shutdown_timeout_s: float = Field(300.0, gt=0)
    # The global prefix index: redis://[:password@]host:port/db (rediss:// for TLS). None:
    # `mxserve serve` starts a local redis-server (embedded cluster only).
    redis_url: str | None = None
    routing: Routing = Field(default_factory=Routing)
    drafts: Drafts = Field(default_factory=Drafts)  # used with draft_placement "replica"
    kv_transfer: KVTransfer = Field(default_factory=KVTransfer)
    limits: Limits = Field(default_factory=Limits)
    streaming: Streaming = Field(default_factory=Streaming)
    # Bearer tokens the API accepts (comma-separated for several, e.g. during a rotation);
    # None: the MXSERVE_API_KEY environment variable where the app is built, else no auth.
    api_key: SecretStr | None = None
    app_name: str = "mxserve"
    # Where the app's OpenAI API is on the HTTP proxy: {route_prefix}/v1/chat/completions.
    # Apps sharing one Ray cluster need different ones (gRPC picks an app by metadata).
    route_prefix: str = Field("/", pattern=r"^/[A-Za-z0-9._~/-]*$")

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if "model" in self.engine:
            raise ValueError("set the model with `model`, not engine.model")
        self.engine_config()  # raises ValueError on a bad engine option
        if len({self.grpc_port, self.http_port, self.metrics_port}) < 3:
            raise ValueError(f"grpc_port ({self.grpc_port}), http_port ({self.http_port}) and "
                             f"metrics_port ({self.metrics_port}) must differ")
        if self.streaming.direct and self.kv_transfer.tls_cert is not None:
            if "direct" in self.streaming.model_fields_set:
                raise ValueError("streaming.direct sends outputs over plain TCP: leave it off "
                                 "where kv_transfer.tls_cert asks for encrypted traffic between "
                                 "nodes")
            # the default gives way to TLS (a copy: the caller's Streaming stays as given)
            self.streaming = self.streaming.model_copy(update={"direct": False})
        if self.streaming.intake is True and not self._intake_possible:
            raise ValueError("streaming.intake needs streaming.direct (its outputs come over the "
                             "routers' output channels) and routing.policy prefix (the routers "
                             "route with it)")
        return self

    @property
    def _intake_possible(self) -> bool:
        return self.streaming.direct and self.routing.policy == "prefix"

    @property
    def uses_intake(self) -> bool:
        """Requests go to the workers over the routers' intake connections (streaming.intake;
        by default wherever direct streams and the prefix policy are on)."""
        if self.streaming.intake is None:
            return self._intake_possible
        return self.streaming.intake

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> ServeConfig:
        """Read a YAML or JSON file; `overrides` (non-None values) win over the file."""
        with open(path, encoding="utf-8") as f:
            if path.endswith(".json"):
                data = json.load(f)
            else:
                import yaml

                data = yaml.safe_load(f) or {}
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def token_digests(self) -> list[str]:
        """SHA-256 digests of the accepted API tokens (the router holds only these); empty
        when auth is off."""
        from mxserve.router.ingress import TokenAuth

        keys = self.api_key.get_secret_value() if self.api_key is not None \
            else os.environ.get(API_KEY_ENV, "")
        return [TokenAuth.digest(k.strip()) for k in keys.split(",") if k.strip()]

    @property
    def index_namespace(self) -> str:
        return f"mxserve:{self.app_name}"

    @property
    def uses_draft_replicas(self) -> bool:
        spec = self.engine_config().speculative_config
        return spec is not None and spec.draft_placement == "replica"

    @property
    def uses_prefix_index(self) -> bool:
        return self.routing.policy == "prefix" and self.redis_url is not None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, **self.engine)

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model in (None, "smollm2"):
            return SMOLLM2_NAME
        return os.path.basename(os.path.normpath(self.model)).removesuffix(".gguf")
