"""Typed failures of the data plane. Callers catch `TransferError`; `TransferFailed` means "re-prefill"."""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every data-plane failure."""


class ChecksumMismatch(TransferError):
    """The payload's xxh3-64 at the receiver differs from the sender's: the bytes are corrupt."""

    def __init__(self, key: str, expected: int, actual: int) -> None:
        super().__init__(f"KV {key!r}: checksum {actual:#018x} != expected {expected:#018x}")
        self.key = key
        self.expected = expected
        self.actual = actual


class KeyNotFound(TransferError):
    """The peer holds no KV under this key (never published, dropped, or already released)."""


class PushRejected(TransferError):
    """The peer refused to take the KV (e.g. its pool is full): backpressure, try later or elsewhere."""


class DestinationError(TransferError):
    """The destination buffer cannot take the payload (too small, read-only, not contiguous)."""


class PeerUnavailable(TransferError):
    """Could not reach the peer, or the connection broke (peer died) during the transfer."""


class ClientClosed(TransferError):
    """A transfer started after its client closed (its service is stopping): no new UCX context for it."""


class TransferTimeout(TransferError):
    """One attempt took longer than the retry policy's per-attempt timeout."""


class ProtocolError(TransferError):
    """A frame that does not decode, has another protocol version, or arrives out of order."""


class TransferFailed(TransferError):
    """Every attempt failed: the KV did not arrive intact. `__cause__` is the last attempt's error.

    `destination` is the buffer a destination factory allocated for the pull (None if none was), so the
    caller can free it; its contents are undefined.
    """

    def __init__(
        self, key: str, attempts: int, last_error: TransferError, destination: object = None
    ) -> None:
        super().__init__(f"KV {key!r}: failed after {attempts} attempt(s): {last_error}")
        self.key = key
        self.attempts = attempts
        self.last_error = last_error
        self.destination = destination


# errors a new attempt can cure; the rest are answers (no such key, no room, wrong destination)
RETRYABLE_ERRORS: tuple[type[TransferError], ...] = (
    ChecksumMismatch,
    PeerUnavailable,
    TransferTimeout,
    ProtocolError,
)
