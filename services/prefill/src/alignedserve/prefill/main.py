"""`alignedserve prefill`: prompt forward passes, first tokens, KV to the pool, batch staging."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from alignedserve.bus import topics
from alignedserve.bus.messages import ServiceKind
from alignedserve.core.models import ModelLoadError
from alignedserve.engine.engine import LLMEngine
from alignedserve.prefill.config import PrefillSettings
from alignedserve.prefill.metrics import PrefillMetrics
from alignedserve.prefill.worker import PrefillWorker
from alignedserve.service.engine_thread import EngineThread
from alignedserve.service.entry import run_service
from alignedserve.service.logs import get_logger
from alignedserve.service.ops_metrics import register_transfer_metrics
from alignedserve.service.worker import WorkerRuntime
from alignedserve.transfer import KVRegistry, TransferEndpoint
from alignedserve.transfer.kv_store import KvStore, StoreSink
from alignedserve.transfer.leases import Leases, expire_leases
from alignedserve.transfer.memory import TorchMemory

log = get_logger("alignedserve.prefill")


async def serve(settings: PrefillSettings) -> int:
    registry = CollectorRegistry()
    runtime = WorkerRuntime(ServiceKind.PREFILL, settings, registry)
    await runtime.start()  # /health answers while the model loads
    served = KVRegistry()
    # the candidate buffers live in this worker's device memory (the paper's GPU prefetch): a staged
    # batch then moves to the decode GPU device to device; on CPU the same path with device "cpu"
    leases = Leases(settings.staging_lease_ttl_s)  # staged KV nobody pulls is freed in the end
    staging = KvStore(int(settings.staging_bytes), TorchMemory(settings.device), leases)
    sink = StoreSink(staging, served)
    endpoint = TransferEndpoint(served, sink)
    register_transfer_metrics(registry, lambda: endpoint.client.stats)
    engine_thread = EngineThread()  # builds the engine and runs its forwards
    try:
        engine = await engine_thread.call(LLMEngine, settings.engine_config())
        address = await endpoint.start(settings.advertise_host, settings.transfer_port)
        runtime.ucx_address = address.to_bytes()
        worker = PrefillWorker(
            settings, runtime, engine, endpoint, sink, PrefillMetrics(registry, staging), engine_thread
        )
        await runtime.subscribe_events(worker.on_event)
        await runtime.subscribe(
            topics.staging(settings.worker_id), f"stage-{settings.worker_id}", worker.on_stage
        )
        await runtime.subscribe(
            topics.PREFILL, topics.PREFILL_GROUP, worker.on_prompt, worker.prompt_intake()
        )
        runtime.spawn(worker.prefill_loop(), "prefill-loop")
        runtime.spawn(expire_leases(leases, served, worker.staged_lease_expired), "staging-lease-expiry")
        runtime.set_ready()
        log.info(
            "prefill_ready",
            model=engine.model_id,
            dtype=engine.config.dtype,
            attention=engine.runner.decode_backend.name,  # "cpu": the C kernels attend continuation chunks
            ucx=address.to_wire(),
            blocks=engine.allocator.num_blocks,
        )
        await runtime.run_until_drained()
    finally:
        await endpoint.close()
        await runtime.close()
        engine_thread.close()
    return 0


def main(argv: list[str]) -> int:
    return run_service(PrefillSettings, serve, argv, __doc__, fatal=(ModelLoadError,))
