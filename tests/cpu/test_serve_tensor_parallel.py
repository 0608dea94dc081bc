"""A tensor-parallel worker replica on the session's two-node Ray cluster (`served`): rank 0 is
the replica, rank 1 a Ray actor in its placement group on the same node, gloo between them. It
answers as one rank does; killing the rank actor ends the request in flight with UNAVAILABLE,
Serve replaces the whole group, and the next request succeeds. A group no node can place is an
error at deploy time."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import ray

from mxserve.cluster.config import Resources, ServeConfig
from mxserve.cluster.local import check_placement
from mxserve.cluster.tp_ranks import rank_actor_name

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _replica(app: str) -> tuple[str, list[str]]:
    """(replica id, the nodes of its group's ranks) of the app's one worker replica."""
    from ray import serve

    prefix = f"SERVE_REPLICA::{app}#Worker#"
    (name,) = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
               if n["namespace"] == "serve" and n["name"].startswith(prefix)]
    nodes = serve.get_deployment_handle("Worker", app).group_node_ids.remote().result()
    return name.removeprefix(prefix), nodes


def _first_success(served, app: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    with served.client(app) as client:
        while True:
            try:
                return client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
            except grpc.RpcError:
                assert time.monotonic() < deadline, "no new group served in time"
                time.sleep(0.5)


def test_a_tensor_parallel_replica_serves_and_is_replaced_when_a_rank_dies(served):
    from ray import serve

    engine = {**served.config.engine, "tensor_parallel_size": 2, "tp_timeout_s": 10}
    app = served.deploy(app_name="tp", num_workers=1, engine=engine, health_check_period_s=1,
                        worker_resources=Resources(num_cpus=0.25, resources={"spare": 1}))
    try:
        want = served.llm.generate([PROMPT], _greedy(8))[0].token_ids
        assert _first_success(served, "tp", 30).token_ids == want
        replica_id, nodes = _replica("tp")
        assert len(nodes) == 2 and len(set(nodes)) == 1  # the group shares one node

        rank1 = ray.get_actor(rank_actor_name(replica_id, 1))
        failed = _kill_mid_stream(served, rank1)
        assert failed.code() == grpc.StatusCode.UNAVAILABLE, failed

        assert _first_success(served, "tp", 120).token_ids == want
        new_id, nodes = _replica("tp")
        assert new_id != replica_id and len(nodes) == 2 and len(set(nodes)) == 1
    finally:
        serve.delete(app.app_name)


def _kill_mid_stream(served, rank) -> grpc.RpcError:
    """Kill `rank` while a long request streams; the error that request (or, if it finished
    first, the next one) ends with, within 10 s of the kill."""
    with served.client("tp") as client:
        stream = client.stream(PROMPT, max_tokens=480, temperature=0, ignore_eos=True)
        next(stream)  # running
        killed = threading.Event()
        threading.Thread(target=lambda: (ray.kill(rank), killed.set())).start()
        killed.wait(10)
        start = time.monotonic()
        try:
            for _ in stream:
                pass
            client.generate(PROMPT, max_tokens=4, ignore_eos=True)
        except grpc.RpcError as e:
            assert time.monotonic() - start < 10
            return e
    pytest.fail("the group served on after its rank was killed")


def test_a_group_no_node_can_hold_is_an_error_at_deploy(served):
    config = ServeConfig(engine={"tensor_parallel_size": 3},
                         worker_resources=Resources(num_cpus=1, num_gpus=1))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 needs 3 x"):
        check_placement(config)
    too_many_cpus = ServeConfig(engine={"tensor_parallel_size": 64},
                                worker_resources=Resources(num_cpus=1))
    with pytest.raises(ValueError, match="in the cluster"):
        check_placement(too_many_cpus)
    check_placement(ServeConfig(engine={"tensor_parallel_size": 2},
                                worker_resources=Resources(num_cpus=1)))  # fits: no error


def _greedy(n: int):
    from mxserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
