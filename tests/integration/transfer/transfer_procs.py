"""Transfer peers as real processes (their own UCX context); a module with its own name so tests can
import it (`conftest` names collide across test folders)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from alignedserve.transfer import PeerAddress

PEER_SCRIPT = Path(__file__).with_name("transfer_peer.py")
PEER_START_TIMEOUT_S = 60.0


class PeerProcess:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), json.dumps(spec)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # blocks until the peer listens (or dies)
        if not line.startswith("READY "):
            self.kill()
            raise RuntimeError(f"transfer peer did not start (exit {self.process.poll()}): {line!r}")
        self.address = PeerAddress.from_wire(line.split()[1])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
