"""KV in the memory each worker chooses (`alignedserve.transfer.memory`), over real UCX: a KV export pushed
into candidate buffers on the staging worker's device, pulled onto the decode worker's device, imported
as the same tensor; and what UCX negotiated, as the logs and metrics report it.

On a machine with a GPU the same test runs with device "cuda": both ends in device memory, UCX moving
it device to device (the paper's GPU-to-GPU prefetch) with no host bounce.
"""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.engine.kv_export import KvExport, KvHeader, checksum
from alignedserve.service.ops_metrics import register_transfer_metrics
from alignedserve.transfer import KVRegistry, RetryPolicy, TransferEndpoint
from alignedserve.transfer import negotiation as negotiation_module
from alignedserve.transfer.kv_store import KvStore, StoreSink
from alignedserve.transfer.memory import TorchMemory, pool_memory

pytestmark = pytest.mark.timeout(60)

POLICY = RetryPolicy(attempts=2, attempt_timeout_s=20.0, connect_timeout_s=5.0)
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def kv_export(device: str, tokens: int = 37) -> KvExport:
    """A bf16 KV payload [layers 2, K/V, tokens, kv_heads 2, head_dim 8] on `device`, as export_kv makes."""
    payload = torch.randn((2, 2, tokens, 2, 8), generator=torch.Generator().manual_seed(tokens))
    payload = payload.to(torch.bfloat16).to(device)
    header = KvHeader("tiny", "bfloat16", 2, 2, 8, tokens, 4, checksum(payload))
    return KvExport(header, payload)


@pytest.mark.parametrize("device", DEVICES)
async def test_kv_moves_between_device_buffers_and_imports_as_the_same_tensor(device: str) -> None:
    kv = kv_export(device)
    envelope = KvEnvelope(kv.header, (5, 6, 7), (8,))
    served = KVRegistry()
    staging = KvStore(1 << 20, TorchMemory(device))  # the prefill worker's candidate buffers
    landing = TorchMemory(device)  # the decode worker's pulls
    async with (
        TransferEndpoint(served, StoreSink(staging, served), policy=POLICY) as stage,
        TransferEndpoint(policy=POLICY) as decode,
    ):
        await decode.push(stage.address, "r", envelope.to_bytes(), kv.payload, checksum=kv.header.checksum)
        held = staging.get("r").payload
        assert isinstance(held, torch.Tensor) and held.device.type == torch.device(device).type
        pulled = await decode.pull(stage.address, "r", lambda _header, nbytes: landing.allocate(nbytes))
        stats = decode.client.stats
    arrived = KvEnvelope.from_bytes(pulled.header).export(pulled.buffer)
    assert arrived.payload.data_ptr() == pulled.buffer.data_ptr()  # wrapped where it landed, no copy
    assert arrived.payload.device == kv.payload.device and arrived.payload.dtype == torch.bfloat16
    assert torch.equal(arrived.payload, kv.payload)
    assert "r" not in staging  # released after its one verified pull
    memory = "cuda" if device == "cuda" else "host"
    assert stats.bytes_by_memory == {
        ("sent", memory): kv.payload.nbytes,
        ("received", memory): kv.payload.nbytes,
    }


async def test_the_negotiated_transports_are_logged_and_exported(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(negotiation_module, "_NEGOTIATED", None)  # read (and logged) again here
    kv = kv_export("cpu", tokens=9)
    registry = CollectorRegistry()
    with caplog.at_level(logging.INFO, logger="alignedserve.transfer.negotiation"):
        async with TransferEndpoint(policy=POLICY) as holder, TransferEndpoint(policy=POLICY) as puller:
            holder.registry.publish("r", b"h", kv.payload, checksum=kv.header.checksum)
            register_transfer_metrics(registry, lambda: puller.client.stats)
            await puller.pull(holder.address, "r", pool_memory().allocate(kv.payload.nbytes))
            negotiated = puller.client.stats.negotiation
    assert negotiated is not None and "tcp" in negotiated.transports
    assert negotiated.device_direct == bool({"cuda_ipc", "rc", "dc"} & set(negotiated.transports))
    text = generate_latest(registry).decode()
    transports = ",".join(negotiated.transports)
    assert f'transports="{transports}"' in text and "alignedserve:ucx_transports_info{" in text
    assert (
        f'alignedserve:kv_transfer_memory_bytes_total{{direction="received",memory="host"}} {float(kv.payload.nbytes)}'
        in text
    )
    [logged] = [r.getMessage() for r in caplog.records if r.name == "alignedserve.transfer.negotiation"]
    assert "'transports': [" in logged and "'device_direct'" in logged
