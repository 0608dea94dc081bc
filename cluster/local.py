"""Starting the serving application: on an embedded local Ray cluster (`mxserve serve`), or
onto an existing Ray cluster (`mxserve serve --address ...`)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

from mxserve.api.errors import MxserveError
from mxserve.cluster.config import ServeConfig
from mxserve.cluster.logs import GRPC_HOST_ENV
from mxserve.cluster.redis_server import LocalRedis

# Ray Serve settings (Serve's own knobs; they are read when the proxy and replica processes
# start, so they go in the environment Ray starts with). The first three make a lower-latency
# token stream (their effect on the serving overhead: bench/results/serve_cpu.md):
# - handle calls (proxy -> router -> worker) over gRPC instead of through the object store;
# - user code on the replica's own event loop instead of a second thread;
# - request logs buffered instead of flushed per line.
# The fourth caps the gRPC proxy's messages at gRPC's own default (Serve raises it to 2 GiB): a
# larger request is RESOURCE_EXHAUSTED before anything parses it. And one for worker loss: a
# replica that failed its health check is killed at once instead of stopped gracefully (a
# wedged or stopped worker would hold its streams, which move only once it is gone, for
# graceful_shutdown_timeout_s).
SERVE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
             "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
             "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
             "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(4 << 20),
             "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1"}


def deploy(config: ServeConfig, timeout_s: float | None = None) -> None:
    """Start Serve (with ingress "proxy" its proxies, gRPC with the mxserve service; with
    "routers" none: the routers serve the ports) and run the application, waiting until every
    replica is up: indefinitely (a cluster may be adding nodes), or at most timeout_s, then
    TimeoutError with Serve's word on what it waits for (e.g. a replica that finds no node with
    its resources). Ray must already be initialized. (On a cluster where Serve already runs,
    its proxies stay as they are.)"""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from mxserve.cluster.deployments import SERVICER, build_app

    check_placement(config)
    if config.ingress == "proxy":
        serve.start(
            proxy_location=config.proxy_location,
            logging_config={"log_level": "WARNING"},  # Serve's own actors; replicas theirs
            http_options={"host": config.host, "port": config.http_port},
            grpc_options=gRPCOptions(port=config.grpc_port, grpc_servicer_functions=[SERVICER],
                                     request_timeout_s=config.request_timeout_s))
    else:
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    # Serve publishes an application to its proxies (gRPC included) only with a route prefix.
    serve.run_many([serve.RunTarget(build_app(config), name=config.app_name,
                                    route_prefix=config.route_prefix)],
                   wait_for_applications_running=False)
    wait_running(config.app_name, timeout_s)


def wait_running(app_name: str, timeout_s: float | None = None) -> None:
    """Until Serve reports the application RUNNING; RuntimeError when its deployment failed,
    TimeoutError (with Serve's status message) when timeout_s passes first."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(app_name)
        state = app.status if app is not None else None
        if state == ApplicationStatus.RUNNING:
            return
        if state == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"deploying application {app_name!r} failed: {app.message}")
        if deadline is not None and time.monotonic() > deadline:
            details = "; ".join(f"{name}: {d.status} {d.message}".strip()
                                for name, d in (app.deployments.items() if app else ()))
            raise TimeoutError(f"application {app_name!r} not running after {timeout_s:g} s "
                               f"({state}: {app.message if app else 'not known to Serve'}; "
                               f"{details})")
        time.sleep(0.2)


def drain_worker(app_name: str, worker_id: str, attempts: int = 200) -> int:
    """Have worker `worker_id` of the app hand its requests on to the other workers and take
    no new ones (`mxserve drain`); how many it handed on. Ray must already be initialized.
    A handle call reaches one replica at a time: it is repeated until that worker answers.
    Raises LookupError when it never does."""
    from ray import serve

    from mxserve.cluster.deployments import WORKER

    handle = serve.get_deployment_handle(WORKER, app_name=app_name)
    for _ in range(attempts):
        moved = handle.drain.remote(worker_id).result(timeout_s=60)
        if moved is not None:
            return moved
    raise LookupError(f"no worker {worker_id!r} answered in app {app_name!r}")


def worker_pids(app_name: str, deployment: str = "Worker") -> dict[str, int]:
    """Each live replica's process id, by replica (worker) id, of the app's worker deployment
    (or of `deployment`, e.g. "Draft"): what a chaos test or benchmark kills (the replicas are
    Ray actors SERVE_REPLICA::<app>#<deployment>#<id> in the "serve" namespace). Ray must
    already be initialized."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    pids = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == "serve" and entry["name"].startswith(prefix):
            actor = ray.get_actor(entry["name"], namespace="serve")
            try:
                pids[entry["name"].removeprefix(prefix)] = ray.get(
                    actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
            except ray.exceptions.RayError:  # died (or dying) since it was listed
                pass
    return pids


def check_placement(config: ServeConfig) -> None:
    """ValueError when the Ray cluster cannot place one worker's tensor-parallel group."""
    import ray

    from mxserve.cluster.tp_ranks import group_fits, rank_bundle

    size = config.engine_config().tensor_parallel_size
    if size > 1:
        why = group_fits(size, rank_bundle(config.worker_resources.ray_actor_options()),
                         ray.nodes())
        if why is not None:
            raise ValueError(why)


def wait_for_grpc(config: ServeConfig, timeout_s: float = 60.0) -> None:
    """Wait until grpc_port answers for the application: with ingress "proxy", until Serve's
    gRPC proxy routes to it (`serve.run` returns when the replicas are up, a moment before the
    proxy learns the new route); with "routers", until the port takes a connection (a router
    is up once its replica is)."""
    import grpc
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"{_url_host(config.host)}:{config.grpc_port}") as channel:
        if config.ingress == "routers":
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
                return
            except grpc.FutureTimeoutError:
                raise TimeoutError(f"no router answered on port {config.grpc_port} within "
                                   f"{timeout_s:.0f} s") from None
        stub = serve_pb2_grpc.RayServeAPIServiceStub(channel)
        while True:
            try:
                apps = stub.ListApplications(serve_pb2.ListApplicationsRequest(), timeout=5)
                if config.app_name in apps.application_names:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gRPC proxy on port {config.grpc_port} did not route to "
                                   f"{config.app_name!r} within {timeout_s:.0f} s")
            time.sleep(0.2)


def init_ray(address: str | None, config: ServeConfig, **ray_options) -> None:
    """Connect to `address`, or start an embedded local Ray (no dashboard) with SERVE_ENV, its
    metrics on `config.metrics_port`, and every process set up by logs.setup_process (client
    errors in one line, the gRPC proxy on `config.host`)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.getLogger("ray.serve").addFilter(_warnings_only)  # this process: no Serve chatter
    if address:
        ray.init(address=address, **ray_options)
        return
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    # Token auth stays on, as Ray makes it for a new local cluster, without the warning Ray
    # prints about that at every start.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
        logging.ERROR)
    runtime_env = {"worker_process_setup_hook": "mxserve.cluster.logs.setup_process",
                   "env_vars": {GRPC_HOST_ENV: config.host}}
    # address "local": a Ray of its own, even where another runs on this machine (which
    # `--address auto` would join)
    ray.init(address="local", include_dashboard=False,
             _metrics_export_port=config.metrics_port, runtime_env=runtime_env, **ray_options)


def _warnings_only(record: logging.LogRecord) -> bool:
    """A filter (Serve resets its loggers' levels): among other things this drops serve.run's
    "ready at http://..." line, which names an HTTP route mxserve does not serve."""
    return record.levelno >= logging.WARNING


def serve_until_stopped(config: ServeConfig, address: str | None = None,
                        ask: str | None = None) -> int:
    """`mxserve serve`: deploy, print one ready line naming every endpoint, and (embedded cluster
    only) block until Ctrl-C or SIGTERM, then stop the application, Ray and Redis, in that
    order. With `address` the application stays on that cluster after this returns. With
    `ask`, send that question over gRPC once the server is up, print the streamed answer, and
    shut down instead of waiting."""
    if not address:
        check_ports_free(config)
    redis = None
    if config.routing.policy == "prefix" and config.redis_url is None:
        if address:
            print("mxserve: no --redis-url given for the Ray cluster: routing by load only "
                  "(start Redis where every node can reach it for prefix-aware routing)",
                  file=sys.stderr, flush=True)
        else:
            redis = LocalRedis().start()
            config = config.model_copy(update={"redis_url": redis.url})
    print(f"mxserve: starting {config.num_workers} worker(s) for {config.served_model_name!r} "
          f"(each loads the model)...", file=sys.stderr, flush=True)
    try:
        init_ray(address, config)
        deploy(config)
        if not address:
            wait_for_grpc(config)
    except BaseException:
        _stop(config, address, redis)
        raise
    print(ready_line(config, address), flush=True)
    if address:
        print(f"mxserve: deployed onto the Ray cluster at {address}; it keeps serving after this "
              f"command exits (remove it with `serve shutdown`).", flush=True)
        return 0
    endpoint = f"{_url_host(config.host)}:{config.grpc_port}"
    if ask is not None:
        key = config.api_key.get_secret_value() if config.api_key is not None else None
        status = _ask(endpoint, config.app_name, ask, key)
    else:
        print(f"mxserve: try `mxserve client \"What is the capital of France?\" --endpoint "
              f"{endpoint}`; Ctrl-C to stop.", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell's `&` job ignores it
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
        status = 0
    print("mxserve: shutting down...", file=sys.stderr, flush=True)
    _stop(config, address, redis)
    return status


def check_ports_free(config: ServeConfig) -> None:
    """The local cluster's ports must be free before it starts. The routers share theirs
    (SO_REUSEPORT) with each other, so a second `mxserve serve` on the same ports would join
    the first one's, each answering the other's clients: refused here, naming the port."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    for name in ("grpc_port", "http_port", "metrics_port"):
        port = getattr(config, name)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((config.host, port))
            except OSError as e:
                raise MxserveError(
                    f"{name} {port} on {config.host} is in use ({e.strerror}; another `mxserve "
                    f"serve`?): pick another with --{name.replace('_', '-')}") from None


def ready_line(config: ServeConfig, address: str | None) -> str:
    """The one line that says the server is up, with every endpoint it serves."""
    if config.uses_prefix_index:
        routing = f"prefix-aware routing, index at {_redacted(config.redis_url)}"
    elif config.routing.policy == "prefix":
        routing = "routing by load (no prefix index)"
    else:
        routing = f"routing: {config.routing.policy}"
    host = config.host if not address else f"<each {_serving_node(config)}>"
    metrics = (f"metrics http://{_url_host(config.host)}:{config.metrics_port}/metrics"
               if not address else "metrics on each node's Ray metrics export port")
    app = f" (app {config.app_name!r})" if config.ingress == "proxy" else ""
    return (f"mxserve: ready: {config.served_model_name!r} on {config.num_workers} worker(s); "
            f"gRPC {host}:{config.grpc_port}{app}; "
            f"OpenAI API {http_base_url(config, address)}; {metrics}; {routing}")


def _serving_node(config: ServeConfig) -> str:
    return "proxy node" if config.ingress == "proxy" else "router node"


def http_base_url(config: ServeConfig, address: str | None = None) -> str:
    """The OpenAI API's base URL (what the openai client takes as base_url)."""
    host = _url_host(config.host) if not address else f"<each {_serving_node(config)}>"
    return f"http://{host}:{config.http_port}{config.route_prefix.rstrip('/')}/v1"


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _stop(config: ServeConfig, address: str | None, redis: LocalRedis | None) -> None:
    """Stop the embedded cluster: the application first (its workers leave the prefix index
    while Redis still runs), then Ray, then the local Redis. An existing cluster is left as it
    is."""
    import ray
    from ray import serve

    if not address and ray.is_initialized():
        try:
            serve.delete(config.app_name)
        except Exception as e:  # a failed start may have left nothing to delete
            print(f"mxserve: stopping the application: {e}", file=sys.stderr, flush=True)
        ray.shutdown()
    if redis is not None:
        redis.stop()


def _ask(endpoint: str, app_name: str, question: str, api_key: str | None = None) -> int:
    """One chat request over gRPC, streamed to stdout; 0 if an answer came back."""
    from mxserve.cluster.client import Client

    print(f"mxserve: asking over gRPC (greedy, up to 64 tokens): {question}", flush=True)
    answer = ""
    with Client(endpoint, app_name, api_key=api_key) as client:
        for chunk in client.stream(messages=[{"role": "user", "content": question}],
                                   max_tokens=64, temperature=0):
            print(chunk.text, end="", flush=True)
            answer += chunk.text
    print(flush=True)
    return 0 if answer.strip() else 1


def _redacted(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
