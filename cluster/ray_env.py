"""Ray settings for these machines, applied before ``ray`` is imported, and joining or starting a cluster."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

RAY_ENV_DEFAULTS = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # otherwise Ray binds the external interface
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_ray_env() -> None:
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


apply_ray_env()

import ray  # noqa: E402  (after the environment above)


def ensure_ray(address: str | None = None) -> None:
    """Use the cluster this process is connected to; else join ``address`` ("auto" finds a running one on this
    host) or $RAY_ADDRESS; else start a fresh local instance (never a stale one from an old address file)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None:
        logger.info("starting a local Ray instance")
        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
        return
    ray.init(address=address, logging_level="WARNING")
