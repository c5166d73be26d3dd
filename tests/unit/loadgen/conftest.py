"""Shared fixtures: the real SmolLM2 tokenizer (loaded once) and the protocol-conformance server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from loadgen_wire_server import build_app

from alignedserve.loadgen.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def smollm2() -> Any:
    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def conformance_server(smollm2: Any) -> Iterator[str]:
    """Base URL of the protocol-conformance server, running in a thread for the whole session."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(smollm2), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("conformance server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()
