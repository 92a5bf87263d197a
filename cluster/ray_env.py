"""Ray settings for these machines, in one place, and joining or starting a cluster.

The settings must be in the environment before ``ray`` is first imported, so this module does not import ray
when it is imported: ``from specray.cluster.ray_env import ray`` applies them and then imports it (every module
of ``specray.cluster`` gets ray that way), and scripts and test setups that import ray themselves call
:func:`apply_ray_env` first.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from types import ModuleType

logger = logging.getLogger(__name__)

RAY_ENV_DEFAULTS = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # otherwise Ray binds the external interface
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # Ray warns at any ray.get in an async actor's process; the engine actors call it only from the engine's own
    # thread (or asyncio.to_thread), never on the event loop, so the warning would only mislead
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
}
# A throwaway cluster on one host (tests): no token to hand around, gloo on loopback. (Elsewhere
# GLOO_SOCKET_IFNAME is the worker's business: it picks loopback only for a loopback rendezvous.)
LOCAL_TEST_ENV_DEFAULTS = {
    "RAY_AUTH_MODE": "disabled",
    "GLOO_SOCKET_IFNAME": "lo",
}


def apply_ray_env(local_test: bool = False) -> None:
    """Set the defaults (never overriding what the environment already says); ``local_test`` adds the
    single-host test cluster's."""
    for key, value in {**RAY_ENV_DEFAULTS, **(LOCAL_TEST_ENV_DEFAULTS if local_test else {})}.items():
        os.environ.setdefault(key, value)


def __getattr__(name: str) -> ModuleType:
    """``ray`` itself, imported on first use, after the settings above."""
    if name != "ray":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    apply_ray_env()
    import ray

    return ray


def ensure_ray(address: str | None = None) -> None:
    """Use the cluster this process is connected to; else join ``address`` ("auto" finds a running one on this
    host) or $RAY_ADDRESS; else start a fresh local instance (never a stale one from an old address file)."""
    apply_ray_env()
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address is not None:
        check_reachable(address)
    # ray.init replaces the process's SIGTERM handler with its own (sys.exit, behind a C handler that aborts the
    # process 3 s later): a handler of the caller's own (specray serve's, which stops what started) is put back
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        if address is None:
            logger.info("starting a local Ray instance")
            ray.init(address="local", include_dashboard=False, logging_level="WARNING")
        else:
            ray.init(address=address, logging_level="WARNING")
    finally:
        if callable(previous):  # (set again even where Python's record is unchanged: the C handler is not)
            signal.signal(signal.SIGTERM, previous)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ValueError at once when nothing answers at a ``host:port`` cluster address (``ray.init`` would retry
    for minutes); "auto", ``ray://`` and other forms are Ray's to resolve."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ValueError(f"address={address!r}: nothing answers there ({err.strerror or err}); give the head node's "
                         "GCS address (host:6379 for a cluster started with `ray start --head`), start the cluster "
                         "first, or leave the address out to start a local Ray") from None
