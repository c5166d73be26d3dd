"""`alignedserve up` waiting for its services: one that never gets ready is named, with its threads' stacks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from free_ports import free_port_block

from alignedserve.up import main as up

STUCK = textwrap.dedent(
    """
    import time
    from alignedserve.core.cli import install_stack_dump

    def stuck_in_startup():
        time.sleep(60)

    install_stack_dump()
    print("started", flush=True)
    stuck_in_startup()
    """
)


def test_a_service_that_never_gets_ready_is_reported_with_its_stack(tmp_path: Path) -> None:
    log_path = tmp_path / "stuck.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", STUCK], stdout=log, stderr=log)
    try:
        while "started" not in log_path.read_text():  # its handler is installed
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{free_port_block(1)}/ready"  # nothing listens there
        with pytest.raises(TimeoutError) as raised:
            up.wait_ready([up.Child("stuck", url, process, log_path)], timeout_s=1.0)
        message = str(raised.value)
        assert message.startswith("not ready after 1s: stuck\n")
        assert "stuck_in_startup" in message  # the frame it hangs in, from its own dump
        assert process.poll() is None  # the dump does not stop it
    finally:
        process.kill()
        process.wait()
