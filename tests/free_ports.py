"""Free loopback ports for stacks started by tests (`up` numbers a stack's ports in a row)."""

from __future__ import annotations

import os
import socket


def free_port_block(size: int, first: int = 21000) -> int:
    """A base port whose next `size` ports are free now, searched from `first` (offset by the pid, so
    concurrent runs seldom race for the same block)."""
    for base in range(first + (os.getpid() % 100) * 100, 60000, 97):
        if all(_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
