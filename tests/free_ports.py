"""Free loopback ports for stacks started by tests (`up` numbers a stack's ports in a row)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port_block(size: int, first: int = 21000) -> int:
    """A base port whose next `size` ports are free now, searched from `first` (offset by the pid, so
    concurrent runs seldom race for the same block). Never in the kernel's ephemeral range: there an
    outgoing connection, or a listener on port 0 (UCX's), could take one of the ports between this
    check and the service's bind."""
    low, high = ephemeral_range()
    for base in range(first + (os.getpid() % 100) * 100, 65536 - size, 97):
        if base + size > low and base <= high:
            continue
        if all(_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block")


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for port 0 (Linux's default where it cannot be read)."""
    try:
        low, high = EPHEMERAL_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
