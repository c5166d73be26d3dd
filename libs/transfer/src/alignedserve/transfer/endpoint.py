"""A KV-holding process's data-plane endpoint: serves its registry, takes pushes, pulls and pushes.

endpoint = TransferEndpoint(sink=engine_import_sink)
address = await endpoint.start(advertise_host="10.0.0.5")   # advertise address.to_wire()
endpoint.registry.publish(request_id, header_bytes, payload_tensor, checksum=header.checksum)
kv = await endpoint.pull(peer_address, request_id, into=lambda header, nbytes: allocate(header, nbytes))
await endpoint.push(peer_address, request_id, header_bytes, payload_tensor)
await endpoint.close()
"""

from __future__ import annotations

from types import TracebackType

from alignedserve.transfer.address import PeerAddress
from alignedserve.transfer.buffers import Buffer
from alignedserve.transfer.client import DestinationFactory, PulledKV, RetryPolicy, TransferClient
from alignedserve.transfer.faults import FaultPlan
from alignedserve.transfer.registry import KVRegistry
from alignedserve.transfer.server import DEFAULT_CHUNK_BYTES, PushSink, TransferServer


class TransferEndpoint:
    def __init__(
        self,
        registry: KVRegistry | None = None,
        sink: PushSink | None = None,
        *,
        policy: RetryPolicy | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        faults: FaultPlan | None = None,
    ) -> None:
        self.registry = registry if registry is not None else KVRegistry()
        self.server = TransferServer(self.registry, sink, chunk_bytes=chunk_bytes, faults=faults)
        self.client = TransferClient(policy, chunk_bytes=chunk_bytes)

    @property
    def address(self) -> PeerAddress:
        return self.server.address

    async def start(self, advertise_host: str = "127.0.0.1", port: int = 0) -> PeerAddress:
        return await self.server.start(advertise_host, port)

    async def pull(self, peer: PeerAddress, key: str, into: Buffer | DestinationFactory) -> PulledKV:
        return await self.client.pull(peer, key, into)

    async def push(
        self, peer: PeerAddress, key: str, header: bytes, payload: Buffer, *, checksum: int | None = None
    ) -> int:
        return await self.client.push(peer, key, header, payload, checksum=checksum)

    async def close(self) -> None:
        await self.client.close()
        await self.server.close()

    async def __aenter__(self) -> TransferEndpoint:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()
