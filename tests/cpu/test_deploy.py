"""deploy/: the KubeRay manifests agree with the code they run (no Kubernetes here: the checks
are what a typo or a renamed field would break before a cluster ever sees it)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from ray import serve
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from mxserve.cluster.client import API_KEY_ENV
from mxserve.cluster.config import ServeConfig
from mxserve.cluster.deployments import SERVICER, app_builder
from mxserve.cluster.local import SERVE_ENV
from mxserve.cluster.tp_ranks import group_fits, rank_bundle

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> list[dict]:
    with open(DEPLOY / "kuberay" / name, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


@pytest.fixture(scope="module")
def service() -> dict:
    (doc,) = [d for d in load("rayservice.yaml") if d["kind"] == "RayService"]
    return doc


@pytest.fixture(scope="module")
def serve_config(service) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def pod_specs(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]]


# ServeConfig fields only `mxserve serve` reads (cluster/local.py); in a RayService the
# serveConfigV2 keys above the application set them, so as args they would be ignored
LOCAL_ONLY = {"host", "grpc_port", "http_port", "metrics_port", "proxy_location",
              "request_timeout_s"}


def test_application_builds_from_its_args(serve_config):
    ServeDeploySchema.model_validate(serve_config)  # Ray Serve's own schema of the file
    (app,) = serve_config["applications"]
    assert not LOCAL_ONLY & set(app["args"])
    module, _, name = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), name)
    assert builder is app_builder
    config = ServeConfig(**app["args"])  # every arg is a ServeConfig field with a valid value
    assert app["route_prefix"] == config.route_prefix and app["name"] == config.app_name
    # as Serve calls an import_path's builder with the config's args (its own helper)
    built = call_user_app_builder_with_args_if_necessary(builder, app["args"])
    assert isinstance(built, serve.Application)
    # serveConfigV2 starts Serve's proxies on the ports: the routers must not bind them too
    assert "ingress" not in app["args"] and built._bound_deployment.init_args[-2] is None
    with pytest.raises(ValueError):
        app_builder({**app["args"], "num_workerz": 2})


def test_grpc_proxy_serves_the_mxserve_service(serve_config, service):
    grpc = serve_config["grpc_options"]
    assert grpc["grpc_servicer_functions"] == [SERVICER]
    module, _, name = SERVICER.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))
    for spec in pod_specs(service):  # proxy_location EveryNode: every pod exposes the port
        ports = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        assert grpc["port"] in ports and serve_config["http_options"]["port"] in ports


def test_every_pod_runs_serve_with_the_environment_mxserve_expects(service):
    for spec in pod_specs(service):
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV
            key = next(e for e in container["env"] if e["name"] == API_KEY_ENV)
            assert key["valueFrom"]["secretKeyRef"]["optional"] is True  # auth if a Secret


def test_tls_envoy_terminates_tls_in_front_of_the_grpc_proxy(serve_config):
    """Envoy listens with TLS (the Secret's certificate), speaks HTTP/2 to the Serve
    service's gRPC port, and only Envoy (and the Ray pods) may reach that port."""
    docs = {d["kind"] + "/" + d["metadata"]["name"]: d
            for d in yaml.safe_load_all((DEPLOY / "kuberay" / "tls-envoy.yaml").read_text())}
    config = yaml.safe_load(docs["ConfigMap/mxserve-envoy"]["data"]["envoy.yaml"])
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    tls = chain["transport_socket"]["typed_config"]["common_tls_context"]
    (cert,) = tls["tls_certificates"]
    mount = next(m for m in docs["Deployment/mxserve-envoy"]["spec"]["template"]["spec"]
                 ["containers"][0]["volumeMounts"] if m["name"] == "tls")
    assert cert["certificate_chain"]["filename"].startswith(mount["mountPath"])
    volumes = docs["Deployment/mxserve-envoy"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "mxserve-tls"}} in volumes
    (cluster,) = config["static_resources"]["clusters"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {
        "address": "mxserve-serve-svc", "port_value": serve_config["grpc_options"]["port"]}
    assert "http2_protocol_options" in str(cluster)  # gRPC upstream
    policy = docs["NetworkPolicy/mxserve-grpc-from-envoy"]["spec"]
    ports = [r for r in policy["ingress"] if "ports" in r]
    assert ports and all(p["port"] == serve_config["grpc_options"]["port"]
                         for r in ports for p in r["ports"])


def test_gpu_pods_fit_the_worker_replicas(serve_config, service):
    args = ServeConfig(**serve_config["applications"][0]["args"])
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert container["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
    # a replica is tensor_parallel_size ranks of worker_resources each, all on one pod
    tp = args.engine_config().tensor_parallel_size
    bundle = rank_bundle(args.worker_resources.ray_actor_options())
    pod = {"Alive": True, "Resources": {"CPU": float(container["resources"]["limits"]["cpu"]),
                                        "GPU": float(gpus)}}
    assert group_fits(tp, bundle, [pod]) is None
    per_pod = gpus // int(tp * args.worker_resources.num_gpus)
    assert args.autoscaling.max_workers <= group["maxReplicas"] * per_pod
    assert args.autoscaling.min_workers <= group["minReplicas"] * per_pod
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_redis_url_names_the_index_service(serve_config):
    args = ServeConfig(**serve_config["applications"][0]["args"])
    (svc,) = [d for d in load("redis.yaml") if d["kind"] == "Service"]
    (deployment,) = [d for d in load("redis.yaml") if d["kind"] == "Deployment"]
    assert args.redis_url == f"redis://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0"
    assert svc["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert args.uses_prefix_index
