"""`alignedserve decode`: a decode worker — the engine plus the per-iteration scheduler.

Reads its own inbox (BatchPlan, PrefetchDone) and the events topic (Cancel, RequestFinished, kvpool
heartbeats); pulls admitted requests' KV over UCX, decodes, publishes tokens to the gateways and a
DecodeStatus to the batcher after every iteration (every `--status-interval-s` while idle).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from alignedserve.bus import topics
from alignedserve.bus.messages import ServiceKind
from alignedserve.decode.config import DecodeSettings
from alignedserve.decode.metrics import DecodeMetrics
from alignedserve.decode.worker import DecodeWorker
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import LoadedModel
from alignedserve.service.engine_thread import EngineThread
from alignedserve.service.entry import run_service
from alignedserve.service.logs import get_logger
from alignedserve.service.ops_metrics import register_transfer_metrics
from alignedserve.service.worker import WorkerRuntime
from alignedserve.transfer import RetryPolicy, TransferEndpoint

log = get_logger("alignedserve.decode")


def inbox_group(worker_id: str) -> str:
    return f"decode-{worker_id}"


async def serve(settings: DecodeSettings, loaded: LoadedModel | None = None) -> int:
    """Run until SIGTERM has drained the worker. `loaded`: an already loaded model (tests)."""
    registry = CollectorRegistry()
    runtime = WorkerRuntime(ServiceKind.DECODE, settings, registry)
    policy = RetryPolicy(attempts=settings.transfer_attempts, attempt_timeout_s=settings.transfer_timeout_s)
    endpoint = TransferEndpoint(policy=policy)
    register_transfer_metrics(registry, lambda: endpoint.client.stats)
    await runtime.start()  # /health answers while the model loads
    engine_thread = EngineThread()  # builds the engine and runs its steps
    try:
        engine = await engine_thread.call(LLMEngine, settings.engine_config(), loaded)
        await engine_thread.call(engine.warm_up)  # before ready: no request pays the first forwards
        address = await endpoint.start(settings.advertise_host, settings.transfer_port)
        runtime.ucx_address = address.to_bytes()
        worker = DecodeWorker(
            settings, engine, runtime.bus, endpoint, DecodeMetrics(registry), runtime.drain, engine_thread
        )
        await runtime.subscribe_events(worker.on_event)
        await runtime.subscribe(topics.decode(settings.worker_id), inbox_group(settings.worker_id),
                                worker.on_decode_topic)  # fmt: skip
        runtime.spawn(worker.run(), "decode-loop")
        runtime.set_ready()
        log.info("decode_ready", worker_id=settings.worker_id, dtype=engine.config.dtype,
                 attention=engine.runner.decode_backend.name, ucx=address.to_wire(),
                 total_blocks=engine.allocator.num_blocks, max_num_seqs=settings.max_num_seqs)  # fmt: skip
        await runtime.run_until_drained()
    finally:
        await runtime.close()
        await endpoint.close()
        engine_thread.close()
    return 0


def main(argv: list[str]) -> int:
    return run_service(DecodeSettings, serve, argv, __doc__)
