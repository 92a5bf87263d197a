"""Serve autoscaling of the engine deployment by the requests in flight on its replicas.

The ingress adds a request to an engine replica with a short unary call and reads its outputs on one long-lived
stream per (ingress, engine replica), so Serve's ongoing-call count on an engine replica says nothing about its
load. Each engine replica reports its in-flight requests instead (``SpecrayEngine.record_autoscaling_stats``),
and :func:`scale_by_requests_in_flight` sizes the deployment the way Serve's default policy does, with that
count in place of ongoing calls. Serve wraps a custom policy in the config's up/downscaling factors, delays and
min/max bounds, so the policy only says how many replicas the load asks for.

This module is pickled by value into the Serve controller: it imports nothing of specray.
"""

from __future__ import annotations

from typing import Any

IN_FLIGHT_METRIC = "requests_in_flight"
"""The key of :meth:`SpecrayEngine.record_autoscaling_stats`'s dict that the policy reads."""


def scale_by_requests_in_flight(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Replicas for ``ctx`` (a ``ray.serve.config.AutoscalingContext``): the replicas' in-flight requests,
    each averaged over ``look_back_period_s``, summed, over ``target_ongoing_requests``. Until some replica has
    reported the metric (none running, or replicas just started), it keeps the current target rather than scale
    down a deployment whose load it cannot see."""
    per_replica = (ctx.aggregated_metrics or {}).get(IN_FLIGHT_METRIC) or {}
    if ctx.current_num_replicas == 0 or not per_replica:
        return ctx.target_num_replicas, {}
    return sum(per_replica.values()) / ctx.config.get_target_ongoing_requests(), {}
