"""Stand-ins for Ray Serve pieces in tests that run an app in this process (registered by conftest as
``specray_test_fakes``)."""

from __future__ import annotations

from types import SimpleNamespace


class FakeDeploymentHandle:
    """Stands in for a one-replica deployment's handle: ``handle.method.remote(*args)`` awaits the target's method,
    or raises as an unreachable replica does while ``down``."""

    def __init__(self, target):
        self.target, self.down = target, False

    def __getattr__(self, name: str):
        method, handle = getattr(self.target, name), self

        async def call(*args):
            if handle.down:
                from ray.exceptions import RayError

                raise RayError("the deployment's replica is gone")
            return await method(*args)

        return SimpleNamespace(remote=call)
