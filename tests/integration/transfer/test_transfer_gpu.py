"""The same transfer code between CUDA tensors: UCX picks cuda_ipc / NVLink (or GPUDirect RDMA)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from transfer_peer import payload_bytes
from transfer_procs import PeerProcess

from alignedserve.transfer import RetryPolicy, TransferClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

StartPeer = Callable[[dict[str, Any]], PeerProcess]


async def test_pull_and_push_between_cuda_tensors(start_peer: StartPeer) -> None:
    nbytes = (6 << 20) + 2
    peer = start_peer(
        {
            "entries": [{"key": "kv", "kind": "torch_bf16", "nbytes": nbytes, "seed": 7}],
            "chunk_bytes": 2 << 20,
        }
    )
    client = TransferClient(RetryPolicy(attempts=2, attempt_timeout_s=30.0), chunk_bytes=2 << 20)
    try:
        destination = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")  # lands in device memory
        await client.pull(peer.address, "kv", destination)
        landed = destination.view(torch.uint8).cpu().numpy()
        assert landed.tobytes() == payload_bytes(nbytes, 7).tobytes()
        assert await client.push(peer.address, "back", b"h", destination) == 1  # sent from device memory
        echo = np.empty(nbytes, np.uint8)
        await client.pull(peer.address, "echo/back", echo)
        assert echo.tobytes() == landed.tobytes()
    finally:
        await client.close()
