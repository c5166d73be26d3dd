"""UCX (ucxx) data plane: checksummed KV transfer between kvpool, prefill and decode processes."""

from __future__ import annotations

from alignedserve.transfer.address import PeerAddress
from alignedserve.transfer.client import (
    ClientStats,
    DestinationFactory,
    PulledKV,
    RetryPolicy,
    TransferClient,
)
from alignedserve.transfer.endpoint import TransferEndpoint
from alignedserve.transfer.errors import (
    ChecksumMismatch,
    ClientClosed,
    DestinationError,
    KeyNotFound,
    PeerUnavailable,
    ProtocolError,
    PushRejected,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from alignedserve.transfer.faults import FaultPlan
from alignedserve.transfer.registry import KVEntry, KVRegistry
from alignedserve.transfer.server import DEFAULT_CHUNK_BYTES, PushSink, TransferServer

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ChecksumMismatch",
    "ClientClosed",
    "ClientStats",
    "DestinationError",
    "DestinationFactory",
    "FaultPlan",
    "KVEntry",
    "KVRegistry",
    "KeyNotFound",
    "PeerAddress",
    "PeerUnavailable",
    "ProtocolError",
    "PulledKV",
    "PushRejected",
    "PushSink",
    "RetryPolicy",
    "TransferClient",
    "TransferEndpoint",
    "TransferError",
    "TransferFailed",
    "TransferServer",
    "TransferTimeout",
]
