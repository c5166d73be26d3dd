"""`Generation.close` is the single exit of a request: a backend whose cancel fails must not make it
raise (uvicorn would log an ASGI error) nor skip the failure metric and the admission slot."""

from __future__ import annotations

import time

import pytest

from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.backend import BackendError, BackendStats, GenerationRequest
from alignedserve.gateway.engine_backend import EngineBackend
from alignedserve.gateway.generation import Generation
from alignedserve.gateway.metrics import GatewayMetrics
from alignedserve.gateway.tokenizer import PromptTokenizer


async def test_a_cancel_that_raises_still_counts_the_failure_and_frees_the_slot(
    engine_backend: EngineBackend, prompt_tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = GatewayMetrics("tiny", BackendStats)
    released: list[str] = []
    request = GenerationRequest(
        "cmpl-close", "tiny", (5, 6, 7), SamplingParams(max_tokens=40), time.monotonic()
    )
    generation = Generation(
        engine_backend, request, prompt_tokenizer, metrics.request_timer(request.arrival_time),
        lambda: released.append(request.request_id),
    )  # fmt: skip
    await generation.start()
    chunks = generation.chunks()
    await anext(chunks)  # it runs: the client leaves mid-stream

    async def broken_cancel(_request_id: str) -> None:
        raise BackendError("the bus refused the cancel")

    real_cancel = engine_backend.cancel
    monkeypatch.setattr(engine_backend, "cancel", broken_cancel)
    await generation.close("client_disconnected")  # does not raise

    assert released == ["cmpl-close"]
    failed = metrics.registry.get_sample_value(
        "alignedserve:request_failure_total", {"model_name": "tiny", "reason": "client_disconnected"}
    )
    assert failed == 1.0
    await generation.close("again")  # idempotent: nothing more is released
    assert released == ["cmpl-close"]
    await real_cancel(request.request_id)  # the fixture checks the engine is left empty
