"""What UCX settled on for this process's transfers: its transports, and the memory each transfer used.

UCX picks a protocol per transfer from the transports its context activated (`UCX_TLS`; by default all it
finds) and the memory type of each buffer: device buffers (`__cuda_array_interface__`) go over cuda_ipc
within a node, RDMA (rc/dc/ud on GPUDirect) across nodes, with no host bounce where both ends are on
GPUs; host buffers over shm (posix/sysv/cma) or tcp. ucxx does not report the lanes of one endpoint, so
this records what can be known: the context's transports (once per process, logged) and, per transfer,
the local buffer's memory type (counted in `ClientStats.bytes_by_memory`, exported as a metric).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from alignedserve.transfer.buffers import ByteView

# transports that move device memory without staging it through host memory
DEVICE_DIRECT_TRANSPORTS = frozenset(
    {"cuda_ipc", "rc", "rc_mlx5", "rc_verbs", "dc", "dc_mlx5", "ud", "ud_mlx5"}
)

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UcxNegotiation:
    version: str
    transports: tuple[str, ...]  # active in the context: what UCX may choose from for each transfer
    tls: str  # UCX_TLS as configured ("all" unless set)

    @property
    def device_direct(self) -> bool:
        """A device-to-device path without a host bounce is available (cuda_ipc or RDMA)."""
        return bool(DEVICE_DIRECT_TRANSPORTS.intersection(self.transports))

    def describe(self) -> dict[str, object]:
        return {
            "ucx_version": self.version,
            "transports": list(self.transports),
            "ucx_tls": self.tls,
            "device_direct": self.device_direct,
        }


_NEGOTIATED: UcxNegotiation | None = None


def negotiation(ucxx: Any) -> UcxNegotiation:
    """The initialised context's transports, read (and logged) once per process."""
    global _NEGOTIATED
    if _NEGOTIATED is None:
        version = ".".join(str(part) for part in ucxx.get_ucx_version())
        transports = tuple(sorted(ucxx.get_active_transports()))
        _NEGOTIATED = UcxNegotiation(version, transports, os.environ.get("UCX_TLS", "all"))
        _log.info("ucx context: %s", _NEGOTIATED.describe())
    return _NEGOTIATED


def memory_kind(view: ByteView) -> str:
    """ "cuda" for a device buffer, "host" otherwise: the memory type UCX sees on this side."""
    return "cuda" if view.is_device else "host"
