"""What travels with a request's KV over the data plane: the KV header and the request's token ids.

The control plane carries only small messages; a request's full token history (needed by whoever
continues it: stop strings, the next input token, re-prefill) rides in the UCX header next to its KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from alignedserve.engine.kv_export import KvExport, KvHeader

ENVELOPE_VERSION = 1


class EnvelopeError(ValueError):
    """The transfer header is not a KV envelope this build understands."""


@dataclass(frozen=True)
class KvEnvelope:
    kv: KvHeader
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # generated so far; the last one is not in the KV yet

    def to_bytes(self) -> bytes:
        body = {
            "v": ENVELOPE_VERSION,
            "kv": self.kv.to_bytes(),
            "prompt": list(self.prompt_token_ids),
            "output": list(self.output_token_ids),
        }
        packed: bytes = msgpack.packb(body)
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> KvEnvelope:
        try:
            body = msgpack.unpackb(data)
            if body.get("v") != ENVELOPE_VERSION:
                raise EnvelopeError(
                    f"KV envelope version {body.get('v')!r}, this build reads {ENVELOPE_VERSION}"
                )
            return cls(KvHeader.from_bytes(body["kv"]), token_ids(body["prompt"]), token_ids(body["output"]))
        except EnvelopeError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EnvelopeError(f"malformed KV envelope: {exc!r}") from exc

    def export(self, payload: bytes | bytearray | memoryview | torch.Tensor) -> KvExport:
        """The received payload as an importable KvExport (no copy for a writable buffer or a uint8
        tensor, which stays on its device)."""
        return KvExport.from_buffer(self.kv, payload)


def token_ids(values: object) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(isinstance(v, int) and v >= 0 for v in values):
        raise EnvelopeError(f"token ids must be a list of ints >= 0, got {values!r:.80}")
    return tuple(values)
