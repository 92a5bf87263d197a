"""A recorder of host syncs: every aten op inside it that needs a tensor's value on the host. Imported as
``specray_test_host_sync`` (tests/conftest.py registers it); the ``no_host_sync`` fixture is built on it."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "repeat_interleave", "_unique2", "unique_dim",
             "unique_consecutive"}


class SyncRecorder(TorchDispatchMode):
    """Records every aten op that needs a tensor's value on the host: ``.item()``, ``bool(t)``, ``int(t)`` go
    through ``_local_scalar_dense``; output-size-dependent ops and boolean-mask indexing sync too."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in _SYNC_OPS:
            self.syncs.append(name)
        elif name.startswith("index") and any(
            getattr(i, "dtype", None) is not None and str(i.dtype) == "torch.bool"
            for a in args if isinstance(a, (list, tuple)) for i in a
        ):
            self.syncs.append(name + "[bool mask]")
        return func(*args, **(kwargs or {}))


def sync_recorder() -> SyncRecorder:
    """``with sync_recorder() as rec: ...``: ``rec.syncs`` names each syncing op the block ran."""
    return SyncRecorder()
