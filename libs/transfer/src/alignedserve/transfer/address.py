"""Where a transfer endpoint listens: the small value a worker advertises on the control plane."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class PeerAddress:
    """host and port of a transfer endpoint's UCX listener; `to_wire()` is what control messages carry."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("peer address needs a host")
        if not 0 < self.port < 65536:
            raise ValueError(f"peer address port {self.port} is outside 1..65535")

    def to_wire(self) -> str:
        """'host:port', with IPv6 hosts in brackets ('[::1]:4000')."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def to_bytes(self) -> bytes:
        return self.to_wire().encode()

    @classmethod
    def from_wire(cls, text: str | bytes) -> PeerAddress:
        value = text.decode() if isinstance(text, bytes) else text
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"not a transfer address (want 'host:port'): {value!r}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            raise ValueError(f"IPv6 transfer address needs brackets ('[host]:port'): {value!r}")
        return cls(host, int(port))

    def __str__(self) -> str:
        return self.to_wire()
