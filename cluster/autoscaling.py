"""Custom Serve autoscaling policies: the draft replicas on their own load (`DraftLoadPolicy`),
and the workers on the requests they hold when requests reach them without Serve
(`InFlightPolicy`, with ServeConfig.streaming.intake).

Autoscaling of the draft replicas on their own load. Workers reach a draft replica over
worker/draft_channel.py, not through Serve, so Serve's default policy (ongoing handle requests)
sees none of that traffic. Each draft replica reports the fraction of time its drafting thread
was busy (`DraftDeployment.record_autoscaling_stats`, metric `draft_busy`), and this policy asks
for enough replicas to keep that fraction near `target_busy`:

    desired = ceil(sum of the replicas' busy fractions / target_busy), at least 1

(no decision while no replica runs or none has reported). Serve applies the autoscaling config
around it (upscale / downscale delays, min / max replicas). No Ray imports: Serve calls it with
its AutoscalingContext, and it reads only the fields named here."""

from __future__ import annotations

import math

BUSY_METRIC = "draft_busy"


class DraftLoadPolicy:
    def __init__(self, target_busy: float = 0.6) -> None:
        if not 0 < target_busy <= 1:
            raise ValueError(f"target_busy must be in (0, 1], got {target_busy}")
        self.target_busy = target_busy

    def __call__(self, ctx) -> tuple[int, dict]:
        reports = (ctx.aggregated_metrics or {}).get(BUSY_METRIC) or {}
        if _starting(ctx, reports):
            return ctx.target_num_replicas, {}
        busy = sum(reports.values())
        return max(1, math.ceil(busy / self.target_busy - 1e-9)), {"busy": busy}


def _starting(ctx, reports: dict) -> bool:
    """No replica runs yet, or none has reported: a policy makes no decision then (it keeps
    the current target, as Serve's default policy does), so the scale-down delay does not run
    while the first replicas load and a deployment's initial replicas are not stopped at once."""
    return ctx.current_num_replicas == 0 or not reports


IN_FLIGHT_METRIC = "worker_in_flight"


class InFlightPolicy:
    """The workers under request intake (cluster/intake.py): routers send requests over TCP,
    so Serve's default policy, which counts the calls it routes, would see none. Each worker
    reports the requests it has admitted and not finished (`record_autoscaling_stats`), and
    this asks for Serve's own rule on them:

        desired = ceil(sum of the workers' requests / target), at least 1

    (`target` is the autoscaling config's target_ongoing_requests.)"""

    def __init__(self, target: float) -> None:
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        self.target = target

    def __call__(self, ctx) -> tuple[int, dict]:
        reports = (ctx.aggregated_metrics or {}).get(IN_FLIGHT_METRIC) or {}
        if _starting(ctx, reports):
            return ctx.target_num_replicas, {}
        in_flight = sum(reports.values())
        return max(1, math.ceil(in_flight / self.target - 1e-9)), {"in_flight": in_flight}
