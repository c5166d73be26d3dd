"""Child-process side of the KV transfer test: a second engine that imports a request's KV and decodes."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

import torch
from engine_models import TINY_OPT, random_model, tiny_engine

from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_export import KvExport, KvHeader


def decode_imported(model_name: str, conn: Connection) -> None:
    """Receive (header bytes, payload bytes, prompt, first token, params); import; re-export to prove the
    round trip; decode to the end; send back (re-exported payload bytes, output tokens, logprobs)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    header_bytes, payload, prompt, output, params = conn.recv()
    engine = _engine(model_name)
    kv = KvExport.from_buffer(KvHeader.from_bytes(header_bytes), payload)
    engine.import_request("moved", kv, prompt, output, params)
    round_trip = bytes(engine.export_kv("moved").payload_view())
    final = None
    while engine.has_unfinished():
        for result in engine.step():
            if result.finished:
                final = result
    assert final is not None
    logprobs = [entry.logprob for entry in final.logprobs or []]
    conn.send((round_trip, final.output_token_ids, logprobs))
    conn.close()


def _engine(model_name: str) -> LLMEngine:
    if model_name == "smollm2":
        return LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20))
    return tiny_engine(random_model(TINY_OPT), "tiny-opt")
