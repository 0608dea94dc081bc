"""CPU tests: Triton kernels run in the interpreter.

It must be chosen before triton is first imported, hence here rather than in each test module.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import pytest  # noqa: E402

# What a compile script starts with (the `compile_outside_interpreter` fixture). The interpreter
# also takes code the compiler refuses (a plain global read in a kernel, say), so kernels are
# compiled for a GPU target too, with no GPU: in a subprocess without TRITON_INTERPRET.
COMPILE_PRELUDE = r'''
import contextlib, io, json, os
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas's log on stdout, on every compile
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # (a cache hit would skip ptxas and its log)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_for(fn, const, types=None, pointer="*bf16", arch=90, aligned=(), **options):
    """(kernel, ptxas log) of jit function fn compiled for sm_<arch>: arguments in const are
    constexprs; `*_ptr` ones types[name] (else `pointer`); eps and qk_scale fp32; others i32.
    aligned: argument names (and every pointer and stride) specialized as 16-divisible, as a
    launch with aligned values does (when given)."""
    types = types or {}
    sig = {n: "constexpr" if n in const else types.get(n, pointer) if n.endswith("_ptr")
           else "fp32" if n in ("eps", "qk_scale") else "i32" for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if aligned and n not in const
             and (n.endswith("_ptr") or n.startswith("stride") or n in aligned)}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs),
                                target=GPUTarget("cuda", arch, 32), options=options)
    return kernel, log.getvalue()
'''


@pytest.fixture(scope="session")
def compile_outside_interpreter():
    """run(script, timeout) -> the last line the script prints: COMPILE_PRELUDE + script in a
    Python subprocess without TRITON_INTERPRET; fails the test on a non-zero exit."""
    def run(script: str, timeout: int = 900) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", COMPILE_PRELUDE + script], env=env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.splitlines()[-1]
    return run


@pytest.fixture(scope="session")
def random_eagle_head(tmp_path_factory):
    """make(checkpoint path, seed) -> a directory holding an EAGLE head of random weights for
    that checkpoint's model (drafts mostly wrong, some right: speculation's tests)."""
    def make(checkpoint: str, seed: int = 1, std: float = 0.2) -> str:
        from mxserve.worker.eagle import save_head
        from mxserve.worker.eagle_train import init_head
        from mxserve.worker.model.loader import open_checkpoint

        path = str(tmp_path_factory.mktemp("head"))
        config = open_checkpoint(checkpoint).config
        save_head(init_head(config, seed=seed, std=std), path, config.model_id)
        return path
    return make


MB = 2**20
DEPLOY_TIMEOUT_S = 300  # an app whose replicas cannot start fails its test, not the session
NODE_SETTLE_S = 5.0
SERVED_ENGINE = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=16, num_threads=1)


# ---- the multi-node serving cluster of test_serve_cluster.py ---------------------------------


def _raylet_alive(node) -> bool:
    from ray._private import ray_constants

    (raylet,) = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
    return raylet.process.poll() is None


class Streams:
    """One greedy streaming client a prompt. `results()`: each one's token ids (or its gRPC error);
    `wait_first_output()` returns once every stream has had a token, so a fault injected then
    lands mid-stream however fast the workers decode."""

    def __init__(self, served, app: str, prompts: list[list[int]], max_tokens: int) -> None:
        self.first = [threading.Event() for _ in prompts]
        pool = ThreadPoolExecutor(len(prompts))
        self.futures = [pool.submit(self._one, served, app, p, max_tokens, e)
                        for p, e in zip(prompts, self.first)]
        pool.shutdown(wait=False)

    @staticmethod
    def _one(served, app, prompt, max_tokens, first: threading.Event):
        import grpc

        tokens: list[int] = []
        with served.client(app) as client:
            try:
                for r in client.stream(prompt, temperature=0, max_tokens=max_tokens,
                                       ignore_eos=True):
                    tokens += r.token_ids
                    first.set()
                return tokens
            except grpc.RpcError as e:
                return e.code().name
            finally:
                first.set()

    def wait_first_output(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for e in self.first:
            assert e.wait(max(0.0, deadline - time.monotonic())), "a stream had no output"
        assert not any(f.done() for f in self.futures), "a stream ended before the fault"

    def results(self) -> list:
        return [f.result(timeout=300) for f in self.futures]


class Served:
    """The running cluster: the main app's config, its offline twin, and helpers."""

    def __init__(self, cluster, config, llm) -> None:
        self.cluster, self.config, self.llm = cluster, config, llm
        self.endpoint = f"localhost:{config.grpc_port}"

    def client(self, app: str | None = None, **kwargs):
        from mxserve.cluster.client import Client

        return Client(self.endpoint, app or self.config.app_name, **kwargs)

    def add_nodes(self, count: int, **node_args) -> list:
        """`count` new nodes of the cluster (Cluster.add_node's arguments), each seen alive for
        NODE_SETTLE_S: a raylet that exits right after joining (seen in a full run; the GCS
        marks it dead only ~15 s later, after wait_for_nodes passed) is replaced rather than
        left to strand the replicas that were to go there."""
        nodes = [self.cluster.add_node(**node_args) for _ in range(count)]
        for _ in range(3):
            self.cluster.wait_for_nodes()
            deadline = time.monotonic() + NODE_SETTLE_S
            while not (dead := [n for n in nodes if not _raylet_alive(n)]) and \
                    time.monotonic() < deadline:
                time.sleep(0.25)
            if not dead:
                return nodes
            for node in dead:
                self.cluster.remove_node(node, allow_graceful=False)
                nodes[nodes.index(node)] = self.cluster.add_node(**node_args)
        self.remove_nodes(nodes)
        raise RuntimeError(f"added nodes' raylets kept exiting ({node_args})")

    def remove_nodes(self, nodes: list) -> None:
        for node in nodes:
            self.cluster.remove_node(node)

    def deploy(self, **overrides):
        from mxserve.cluster.config import ServeConfig
        from mxserve.cluster.local import deploy, wait_for_grpc

        if "app_name" in overrides:  # each app its own HTTP path (gRPC: by metadata)
            overrides.setdefault("route_prefix", f"/{overrides['app_name']}")
        config = ServeConfig(**{**self.config.model_dump(), **overrides})
        deploy(config, timeout_s=DEPLOY_TIMEOUT_S)
        wait_for_grpc(config)
        return config

    def wait_indexed(self, prefix: list[int], config=None, timeout_s: float = 20.0
                     ) -> dict[str, int]:
        """Until some worker holds all of `prefix`'s full blocks in the Redis index (its KV
        events arrive asynchronously): then the leading blocks each worker holds. config: the
        app's ServeConfig (default the main app's)."""
        import asyncio

        from mxserve.api.block_hash import block_hashes
        from mxserve.api.prefix_index import PrefixIndex
        from mxserve.worker.model.loader import open_checkpoint

        config = config or self.config
        model_id = open_checkpoint(config.model).config.model_id
        hashes = block_hashes(prefix, 16, model_id)

        async def held() -> dict[str, int]:
            index = PrefixIndex.from_url(config.redis_url, config.index_namespace)
            try:
                return await index.lookup(hashes)
            finally:
                await index.close()

        deadline = time.monotonic() + timeout_s
        while max((got := asyncio.run(held())).values(), default=0) < len(hashes):
            assert time.monotonic() < deadline, "the prefix never reached the index"
            time.sleep(0.05)
        return got

    def streams(self, app: str, prompts: list[list[int]], max_tokens: int) -> Streams:
        return Streams(self, app, prompts, max_tokens)

    def requests_per_worker(self, app: str | None = None) -> dict[str, int]:
        return {w.worker_id: w.num_requests_total for w in self.wait_idle(app)}

    @staticmethod
    def streamed(client, prompt, **params) -> tuple:
        """One request streamed by `client`: (token ids, text, finish reason, completion
        tokens) as the messages add up."""
        chunks = list(client.stream(prompt, **params))
        return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                chunks[-1].finish_reason, chunks[-1].usage.completion_tokens)

    def wait_idle(self, app: str | None = None, timeout_s: float = 20.0, **client_args):
        """Every worker's load once none runs, waits or holds KV blocks (or fail).
        client_args: the client's (an app's api_key)."""
        deadline = time.monotonic() + timeout_s
        with self.client(app, **client_args) as client:
            while True:
                loads = client.health().workers
                if all(w.num_running == w.num_waiting == w.num_kv_blocks_used == 0
                       for w in loads):
                    return loads
                assert time.monotonic() < deadline, f"workers still busy: {loads}"
                time.sleep(0.05)


@pytest.fixture(scope="session")
def monkeypatch_env():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _start_head(cluster_class, head_args: dict, attempts: int = 2):
    """A ray.cluster_utils.Cluster with its head node. Ray gives a starting raylet a fixed 30 s
    to register with the GCS; a busy 2-core CI machine once missed it and every served test
    errored. A miss is retried once, after `ray stop --force` clears the half-started node's
    processes (the session's only Ray: one per test session)."""
    for attempt in range(attempts):
        cluster = cluster_class(initialize_head=False)
        try:
            cluster.add_node(**head_args)
            return cluster
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts - 1:
                raise
            cluster.shutdown()
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                           capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def served(tiny_checkpoint, monkeypatch_env, redis_server):
    """A local multi-node Ray cluster serving a tiny Llama over gRPC, with prefix-aware
    routing against a real redis-server: one for the session (test_serve_cluster.py,
    test_serve_routing.py)."""
    import ray
    from ray.cluster_utils import Cluster

    from mxserve import LLM
    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.local import SERVE_ENV, deploy, wait_for_grpc
    from mxserve.cluster.redis_server import free_port

    for key, value in SERVE_ENV.items():  # as `mxserve serve` starts Ray
        monkeypatch_env.setenv(key, value)
    model = str(tiny_checkpoint("llama"))
    cluster = _start_head(Cluster, dict(
        num_cpus=4, resources={"router_node": 4, "spare": 4}, include_dashboard=False,
        object_store_memory=512 * MB, _system_config={"metrics_report_interval_ms": 1000}))
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={"worker_node": 1}, object_store_memory=128 * MB)
    ray.init(address=cluster.address)
    config = ServeConfig(
        model=model, app_name="tiny", num_workers=2, engine=SERVED_ENGINE, max_queued_requests=16,
        worker_resources=Resources(num_cpus=0.5, resources={"worker_node": 1}),
        router_resources=Resources(num_cpus=0.25, resources={"router_node": 1}),
        grpc_port=free_port(), http_port=free_port(), proxy_location="HeadOnly",
        ingress="proxy",  # several apps on the one cluster: Serve's proxies pick by name
        redis_url=redis_server.url, routing=dict(retry_after_s=0.5))
    try:
        deploy(config, timeout_s=DEPLOY_TIMEOUT_S)
        wait_for_grpc(config)
        yield Served(cluster, config, LLM(model=model, load_progress=False, **SERVED_ENGINE))
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
