"""Placement groups for the target's ranks and the drafter's: created, awaited and removed in one place.

Every group is named ``specray:<owner>:<role>:<random>``, the owner being the actor (or job) that created it,
so whoever owns that actor can remove what it left behind (:func:`remove_owned`) when it could not clean up
itself: a placement group created by a non-detached actor outlives the actor, until the job ends.

A request the cluster can never hold (more CPUs per node than any node has, more ranks than fit in all the nodes
together, counting what the placing actor and the groups it placed before hold) fails at once with what to
change, instead of waiting for resources that will not come; on a cluster that grows (an autoscaler: set
``SPECRAY_RAY_AUTOSCALING=1``) it waits, up to ``PLACEMENT_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

from specray.cluster.ray_env import ray

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # a group that cannot be placed in this long asks for more than the cluster has
SETUP_TIMEOUT_S = 600.0  # a placed group's ranks loading their shards of a large model
NAME_PREFIX = "specray"
AUTOSCALING_ENV = "SPECRAY_RAY_AUTOSCALING"


def owner_id() -> str:
    """The actor this code runs in (else the job): the owner part of the names of the groups it creates."""
    context = ray.get_runtime_context()
    return context.get_actor_id() or context.get_job_id()


def create(bundles: list[dict], strategy: str, role: str, advice: str):
    """A ready placement group for ``bundles``; ValueError (ending in ``advice``, what to change) at once when
    no autoscaler may grow the cluster and its nodes could never hold them, or after ``PLACEMENT_TIMEOUT_S``."""
    from ray.util.placement_group import placement_group, remove_placement_group

    what = f"{len(bundles)} {role} ranks with {bundles[0]} each ({strategy})"
    nodes = capacities()
    missing = missing_resources(bundles, nodes)
    if missing and not autoscaling():
        raise ValueError(f"cannot place {what}: no node of the cluster has {_names(missing)} (the custom "
                         f"resources its nodes have: {_names(custom_resources(nodes)) or 'none'}; no autoscaler, "
                         f"{AUTOSCALING_ENV} is not set); start nodes with it (ray start --resources) or change "
                         f"{_RESOURCE_OPTIONS.get(role, 'the resources asked for')}")
    if not could_ever_fit(bundles, strategy, nodes) and not autoscaling():
        raise ValueError(f"cannot place {what}: the cluster's nodes could never hold them (each node's total, "
                         f"less what the actor placing them and its earlier groups hold: "
                         f"{[_shown(n, bundles) for n in nodes]}; no "
                         f"autoscaler, {AUTOSCALING_ENV} is not set); {advice}")
    pg = placement_group(bundles, strategy=strategy, name=f"{NAME_PREFIX}:{owner_id()}:{role}:{uuid.uuid4().hex[:8]}")
    if not ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
        remove_placement_group(pg)
        raise ValueError(f"cannot place {what}: still not placed after {PLACEMENT_TIMEOUT_S:.0f}s (free now: "
                         f"{ray.available_resources()}); {advice}")
    return pg


def rendezvous_address() -> str:
    """A tcp:// address on this node with a free port, for rank 0 of a group to host the process group's store."""
    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"tcp://{ip}:{port}"


def remove(pg) -> None:
    from ray.util.placement_group import remove_placement_group

    if pg is not None:
        remove_placement_group(pg)


def remove_owned(owner: str) -> int:
    """Remove every live group that ``owner`` (an actor id) created; returns how many there were."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    removed = 0
    for info in ray.util.placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(f"{NAME_PREFIX}:{owner}:") and info.get("state") != "REMOVED":
            remove_placement_group(get_placement_group(name))
            removed += 1
    if removed:
        logger.warning("removed %d placement groups left behind by actor %s", removed, owner)
    return removed


def autoscaling() -> bool:
    """Whether the cluster may grow (then a group that does not fit now may fit later)."""
    return os.environ.get(AUTOSCALING_ENV, "").lower() in ("1", "true", "yes")


def capacities() -> list[dict]:
    """Each live node's total resources, less what the actor calling this holds on its own node and the bundles
    of the groups it placed before (a drafter's group after the target's): it holds both as long as the groups
    it creates live, so they can never go to those groups."""
    context = ray.get_runtime_context()
    here = context.get_node_id()
    held = {here: [context.get_assigned_resources()]} if context.get_actor_id() else {}
    for node_id, bundle in _own_bundles(owner_id()):
        held.setdefault(node_id, []).append(bundle)
    nodes = []
    for node in ray.nodes():
        if node["Alive"]:
            total = dict(node["Resources"])
            for bundle in held.get(node["NodeID"], []):
                for key, amount in bundle.items():
                    total[key] = total.get(key, 0) - amount
            nodes.append(total)
    return nodes


def _own_bundles(owner: str) -> list[tuple[str, dict]]:
    """(node id, resources) of every placed bundle of the live groups ``owner`` created."""
    out = []
    for info in ray.util.placement_group_table().values():
        if (info.get("name") or "").startswith(f"{NAME_PREFIX}:{owner}:") and info.get("state") == "CREATED":
            nodes = info.get("bundles_to_node_id") or {}
            out += [(nodes[i], dict(bundle)) for i, bundle in (info.get("bundles") or {}).items() if i in nodes]
    return out


_RESOURCE_OPTIONS = {"target": "ray_placement.worker_resources", "draft": "ray_placement.drafter_resources"}


def missing_resources(bundles: list[dict], nodes: list[dict]) -> list[str]:
    """The custom resources (not CPU or GPU, which the sizes' own check covers) that ``bundles`` ask for and no node
    of ``nodes`` has at all: a name no node was started with."""
    have = {key for node in nodes for key in node}
    return sorted({key for bundle in bundles for key, amount in bundle.items()
                   if amount > 0 and key not in have and key not in ("CPU", "GPU")})


def custom_resources(nodes: list[dict]) -> list[str]:
    """The resources of ``nodes`` beside Ray's own (CPU, GPU, memory, object store, node:<ip>, accelerator types)."""
    own = ("CPU", "GPU", "memory", "object_store_memory")
    return sorted({key for node in nodes for key in node
                   if key not in own and not key.startswith(("node:", "accelerator_type:"))})


def _names(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys)


def could_ever_fit(bundles: list[dict], strategy: str, nodes: list[dict]) -> bool:
    """Whether ``nodes`` (each its total resources), all empty, could hold ``bundles`` under ``strategy``: on one
    node (STRICT_PACK), each on its own node (STRICT_SPREAD), or anyhow (PACK, SPREAD: a bin packing, solved
    exactly by search; groups are a few ranks)."""
    if strategy == "STRICT_PACK":
        total = {k: sum(b.get(k, 0) for b in bundles) for b in bundles for k in b}
        return any(_fits(total, node) for node in nodes)
    order = sorted(bundles, key=lambda b: -sum(b.values()))  # big first: dead ends show early
    return _place(order, [dict(n) for n in nodes], strategy == "STRICT_SPREAD", set())


def _place(bundles: list[dict], free: list[dict], one_per_node: bool, used: set[int]) -> bool:
    if not bundles:
        return True
    need, rest = bundles[0], bundles[1:]
    tried: list[dict] = []
    for i, node in enumerate(free):
        if (one_per_node and i in used) or not _fits(need, node) or node in tried:
            continue
        tried.append(dict(node))  # an identical node left as it was would fail the same way
        for k, v in need.items():
            node[k] = node.get(k, 0) - v
        if _place(rest, free, one_per_node, used | {i}):
            return True
        for k, v in need.items():
            node[k] += v
    return False


def _fits(need: dict, node: dict) -> bool:
    return all(node.get(k, 0) >= v - 1e-6 for k, v in need.items())  # Ray counts in 1e-4 units; floats round


def _shown(node: dict, bundles: list[dict]) -> dict:
    """A node's CPUs and GPUs, and its amounts of the custom resources ``bundles`` ask for."""
    asked = sorted({k for b in bundles for k in b} - {"CPU", "GPU"})
    return {k: round(node[k], 4) for k in ("CPU", "GPU", *asked) if node.get(k)}
