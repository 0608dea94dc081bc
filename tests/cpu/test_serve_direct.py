"""Direct output streams served (ServeConfig.streaming.direct, cluster/output_channel.py), on the
session's multi-node cluster (tests/cpu/conftest.py `served`) with two more nodes, one worker
replica each: the engine's outputs go worker -> router over the router's output channel (real
TCP on loopback), the Serve call carrying routing, errors and the request's lifetime. Streams
answer as the offline engine does (greedy, sampled with logprobs, a stop string); a cancel
frees the worker's KV blocks; a worker SIGKILLed mid-stream leaves its streams to go on on the
other worker with the undisturbed tokens. Each test runs twice: requests as Serve calls, and
with request intake (ServeConfig.streaming.intake, cluster/intake.py: the routers route and
send each request over TCP themselves, no Serve call)."""

from __future__ import annotations

import os
import random
import signal
import time

import grpc
import pytest

from mxserve import SamplingParams
from mxserve.cluster.config import Resources
from mxserve.cluster.local import worker_pids

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MB = 2**20


@pytest.fixture(scope="module", params=[False, True], ids=["serve_calls", "intake"])
def direct(served, request):
    from ray import serve

    nodes = served.add_nodes(2, num_cpus=1, resources={"direct_node": 1},
                             object_store_memory=128 * MB)
    app = served.deploy(app_name="intake" if request.param else "direct", num_workers=2,
                        engine=dict(served.config.engine),
                        worker_resources=Resources(num_cpus=0.25, resources={"direct_node": 1}),
                        health_check_period_s=1.0,
                        streaming=dict(direct=True, streams_per_token=2,
                                       max_tokens_per_message=4, intake=request.param),
                        routing=dict(prefix_weight=0.0, lookup_timeout_s=2.0,
                                     stats_period_s=0.25))
    try:
        yield app
    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)


def _router_audit(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("Router", app_name=app).audit.remote().result(
        timeout_s=60)


def test_direct_streams_answer_as_offline(served, direct):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"w{3 + i} w{50 + i}" for i in range(8)]
    params = [dict(temperature=0, max_tokens=16, ignore_eos=True) if i % 2 else
              dict(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True, logprobs=1)
              for i in range(8)]
    expected = served.llm.generate(prompts, [SamplingParams(**p) for p in params])

    def one(i):
        with served.client(direct.app_name) as client:
            return served.streamed(client, prompts[i], **params[i])

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    assert got == [(e.token_ids, e.text, "length", 16) for e in expected]

    full = served.llm.generate("w20", SamplingParams(temperature=0, max_tokens=30,
                                                     ignore_eos=True))[0].text
    stop = full[11:15]
    with served.client(direct.app_name) as client:
        answer = client.generate("w20", temperature=0, max_tokens=30, ignore_eos=True,
                                 stop=[stop])
    assert answer.text == full[:full.index(stop)] and answer.finish_reason == "stop"
    audit = _router_audit(direct.app_name)
    channel = audit["output_channel"]
    assert channel["connections"] >= 1 and channel["frames"] > 0 and channel["rejected"] == 0
    loads = served.wait_idle(direct.app_name)
    assert sum(w.num_requests_total for w in loads) >= 9
    if direct.uses_intake:  # the requests went over the router's intake
        assert audit["intake"]["routed"] >= 9
        assert all(w.num_requests_total >= 1 for w in loads), loads  # spread over both
    else:
        assert audit["intake"] is None


def test_direct_stream_cancel_frees_the_workers_blocks(served, direct):
    with served.client(direct.app_name) as client:
        for _ in range(3):  # (as test_serve_cluster's cancel: the tiny model may finish first)
            aborted = sum(w.num_requests_aborted for w in served.wait_idle(direct.app_name))
            stream = client.stream("w7 w8", max_tokens=480, ignore_eos=True)
            next(stream)
            stream.close()
            loads = served.wait_idle(direct.app_name)
            if sum(w.num_requests_aborted for w in loads) == aborted + 1:
                break
        else:
            pytest.fail("no cancel reached the worker before its request finished")
        with pytest.raises(grpc.RpcError) as e:  # a bad request is still INVALID_ARGUMENT
            client.generate("w7", max_tokens=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(client.generate("w7", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_worker_killed_under_direct_streams_they_end_as_if_undisturbed(served, direct):
    rng = random.Random(31)
    prompts = [[rng.randrange(3, 256) for _ in range(20 + 4 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    want = [o.token_ids for o in served.llm.generate(prompts, params)]
    pids = worker_pids(direct.app_name)
    assert len(pids) == 2, pids

    pending = served.streams(direct.app_name, prompts, 400)
    deadline = time.monotonic() + 60
    with served.client(direct.app_name) as client:
        while True:
            loads = list(client.health().workers)
            if sum(w.num_running for w in loads) == 6 and all(w.num_running for w in loads):
                break
            assert time.monotonic() < deadline, loads
            time.sleep(0.02)
    victim = max(loads, key=lambda w: w.num_running).worker_id
    pending.wait_first_output()
    os.kill(pids[victim], signal.SIGKILL)
    results = pending.results()
    assert results == want, [r if isinstance(r, str) else len(r) for r in results]
