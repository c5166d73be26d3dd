"""A real transfer endpoint in its own process, for the data-plane tests.

Run as `python transfer_peer.py '<json spec>'`: publishes the spec's deterministic payloads, takes
pushes (republishing each landed payload as "echo/<key>" so the test can pull it back and compare
bytes), prints "READY host:port" and serves until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from alignedserve.transfer import FaultPlan, KVRegistry, PushRejected, TransferEndpoint

PAYLOAD_KINDS = ("bytes", "numpy_u8", "torch_fp32", "torch_bf16")


def payload_bytes(nbytes: int, seed: int) -> np.ndarray[Any, Any]:
    """The reference bytes [nbytes] of a test payload: the same in every process."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def make_payload(kind: str, nbytes: int, seed: int, device: str = "cpu") -> Any:
    """The payload as a caller would hold it: bytes, numpy, or a torch tensor of the given dtype."""
    raw = payload_bytes(nbytes, seed)
    if kind == "bytes":
        return raw.tobytes()
    if kind == "numpy_u8":
        return raw
    import torch

    dtype = {"torch_fp32": torch.float32, "torch_bf16": torch.bfloat16}[kind]
    if nbytes == 0:
        return torch.empty(0, dtype=dtype, device=device)
    return (
        torch.from_numpy(raw).view(dtype).to(device)
    )  # the same bytes reinterpreted, e.g. [nbytes / 2] bf16


@dataclass
class EchoSink:
    """Lands pushes in fresh buffers (numpy, or torch on `device`) and serves them back as 'echo/<key>';
    refuses past capacity."""

    registry: KVRegistry
    capacity_bytes: int
    device: str = "cpu"

    def allocate(self, key: str, header: bytes, nbytes: int) -> Any:
        if self.registry.nbytes + nbytes > self.capacity_bytes:
            raise PushRejected(f"no room for {nbytes} bytes")
        if self.device == "cpu":
            return np.empty(nbytes, np.uint8)
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def commit(self, key: str, header: bytes, buffer: Any) -> None:
        self.registry.publish(f"echo/{key}", header, buffer, release_after_pull=False)

    def discard(self, key: str, buffer: Any) -> None:
        return


async def serve(spec: dict[str, Any]) -> None:
    registry = KVRegistry()
    device = spec.get("device", "cpu")
    for entry in spec.get("entries", []):
        payload = make_payload(entry["kind"], entry["nbytes"], entry["seed"], device)
        header = json.dumps({"key": entry["key"], "kind": entry["kind"]}).encode()
        registry.publish(entry["key"], header, payload, release_after_pull=entry.get("release", False))
    sink = EchoSink(registry, spec.get("sink_capacity_bytes", 1 << 34), device)
    faults = FaultPlan(**spec.get("faults", {}))
    endpoint = TransferEndpoint(registry, sink, chunk_bytes=spec.get("chunk_bytes", 8 << 20), faults=faults)
    address = await endpoint.start()
    print(f"READY {address.to_wire()}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
