"""A tensor-parallel worker replica on Ray: the replica is rank 0, ranks 1..N-1 are Ray actors in
the replica's placement group (one bundle each: the worker's resources, bundle 0 the replica's
own), started by `RayRankLauncher` for worker/tp_executor.py. The actors belong to the replica,
so Ray ends them with it: a replaced replica leaves no rank behind.

`group_fits` checks at deploy time that the cluster can place a group at all, so a size no
node (GPUs: STRICT_PACK) or cluster (CPUs: PACK) can hold is an error, not a replica that waits
for resources for ever.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mxserve.worker.config import EngineConfig
from mxserve.worker.tp_executor import RankSpec, run_rank


@ray.remote
class RankActor:
    """Runs one rank for its engine's life (`run` returns when rank 0 stops it or goes away);
    a second concurrent call can still ask where it runs."""

    def run(self, spec: RankSpec) -> None:
        run_rank(spec)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def rank_actor_name(replica_id: str, rank: int) -> str:
    return f"mxserve-tp:{replica_id}:rank{rank}"


class RayRankLauncher:
    """worker/tp_executor.py's RankLauncher over Ray actors in the current placement group."""

    def __init__(self, actor_options: dict, replica_id: str) -> None:
        self.actor_options, self.replica_id = actor_options, replica_id
        self.host = ray.util.get_node_ip_address()
        self.placement_group = ray.util.get_current_placement_group()
        self.actors: list = []
        self.runs: list = []

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        return config  # each actor sees its own GPU as cuda:0, as the replica does

    def start(self, specs: list[RankSpec]) -> None:
        for spec in specs:
            strategy = None
            if self.placement_group is not None:
                strategy = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=spec.rank)
            actor = RankActor.options(
                **self.actor_options, max_concurrency=2, scheduling_strategy=strategy,
                name=rank_actor_name(self.replica_id, spec.rank)).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(spec))

    def alive(self) -> bool:
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return not done

    def node_ids(self) -> list[str]:
        return ray.get([actor.node_id.remote() for actor in self.actors], timeout=30)

    def stop(self, timeout_s: float) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor)


def rank_bundle(resources: dict) -> dict[str, float]:
    """One rank's placement-group bundle from ray_actor_options-style resources."""
    bundle = {"CPU": resources.get("num_cpus", 1), "GPU": resources.get("num_gpus", 0),
              **resources.get("resources", {})}
    return {k: float(v) for k, v in bundle.items() if v}


def group_fits(size: int, bundle: dict[str, float], nodes: list[dict]) -> str | None:
    """Why `size` bundles cannot be placed on these nodes (ray.nodes()), or None. GPU groups
    must fit one node (STRICT_PACK); CPU groups the whole cluster (PACK)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if bundle.get("GPU"):
        for resources in alive:
            if all(resources.get(k, 0) >= size * v for k, v in bundle.items()):
                return None
        return (f"tensor_parallel_size {size} needs {size} x {bundle} on one node; no node of "
                f"this cluster has that ({[_brief(r, bundle) for r in alive]})")
    total = {k: sum(r.get(k, 0) for r in alive) for k in bundle}
    if all(total[k] >= size * v for k, v in bundle.items()):
        return None
    return (f"tensor_parallel_size {size} needs {size} x {bundle} in the cluster; it has "
            f"{total}")


def _brief(resources: dict, bundle: dict) -> dict:
    return {k: resources.get(k, 0) for k in bundle}
