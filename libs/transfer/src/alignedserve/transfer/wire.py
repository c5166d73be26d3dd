"""Frames of the transfer protocol: small msgpack messages on their own UCX tag.

A pull is request -> offer + payload chunks -> done; a push is offer -> ready (or refused) -> chunks -> done:

    PULL  receiver -> holder : PullRequest(id, key)
          holder -> receiver : PayloadOffer(id, key, header, nbytes, checksum, chunk_bytes) | Refused
          holder -> receiver : chunks right behind the offer: UCX tag messages tagged (id, chunk index),
                               matched by the receives the receiver posts into its destination (rendezvous:
                               they wait, uncopied, until posted); one round trip, like a bare send
          receiver -> holder : Done(id, ok, checksum)     (checksum verified; ok releases the entry)
                               or Refused (no destination: the chunks were drained into scratch memory)
    PUSH  sender -> receiver : PayloadOffer(...)
          receiver -> sender : Ready(id) | Refused        (its sink allocated the destination)
          sender -> receiver : chunks
          receiver -> sender : Done(id, ok, checksum)     (checksum verified and committed, or not)

Payload bytes never travel in frames. Transfer ids are chosen by the side that opened the connection,
unique per connection, and never reused (a retry is a new id), so a late chunk cannot land in a new
transfer's destination.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any, TypeAlias

import msgpack

from alignedserve.transfer.errors import ProtocolError

PROTOCOL_VERSION = 1
CHUNK_INDEX_BITS = 24  # chunk tag = (transfer id << 24) | chunk index


@dataclass(frozen=True)
class PullRequest:
    transfer_id: int
    key: str


@dataclass(frozen=True)
class PayloadOffer:
    transfer_id: int
    key: str
    header: bytes  # opaque to the data plane (the engine's KV header)
    nbytes: int
    checksum: int  # xxh3-64 of the payload bytes
    chunk_bytes: int  # the payload travels as ceil(nbytes / chunk_bytes) tagged messages


@dataclass(frozen=True)
class Ready:
    transfer_id: int


@dataclass(frozen=True)
class Refused:
    transfer_id: int
    code: str  # one of REFUSAL_CODES
    reason: str


@dataclass(frozen=True)
class Done:
    transfer_id: int
    ok: bool  # the payload's checksum matched the offer (and, for a push, the sink committed it)
    checksum: int  # xxh3-64 of the bytes that landed


Frame: TypeAlias = PullRequest | PayloadOffer | Ready | Refused | Done

REFUSAL_NOT_FOUND = "not_found"
REFUSAL_REJECTED = "rejected"
REFUSAL_DESTINATION = "destination"
REFUSAL_CODES = (REFUSAL_NOT_FOUND, REFUSAL_REJECTED, REFUSAL_DESTINATION)

_KIND_BY_TYPE: dict[type[Any], int] = {PullRequest: 1, PayloadOffer: 2, Ready: 3, Refused: 4, Done: 5}
_TYPE_BY_KIND = {kind: frame_type for frame_type, kind in _KIND_BY_TYPE.items()}


def encode_frame(frame: Frame) -> bytes:
    packed: bytes = msgpack.packb([PROTOCOL_VERSION, _KIND_BY_TYPE[type(frame)], *astuple(frame)])
    return packed


def decode_frame(data: bytes | memoryview) -> Frame:
    try:
        fields = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException) as error:
        raise ProtocolError(f"undecodable transfer frame: {error}") from error
    if not isinstance(fields, list) or len(fields) < 2:
        raise ProtocolError(f"malformed transfer frame: {fields!r:.200}")
    version, kind, *values = fields
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"transfer protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    frame_type = _TYPE_BY_KIND.get(kind)
    if frame_type is None:
        raise ProtocolError(f"unknown transfer frame kind {kind!r}")
    try:
        frame: Frame = frame_type(*values)
    except TypeError as error:
        raise ProtocolError(f"malformed {frame_type.__name__} frame: {error}") from error
    return frame


def chunk_tag(transfer_id: int, chunk_index: int) -> int:
    return (transfer_id << CHUNK_INDEX_BITS) | chunk_index


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    if chunk_bytes <= 0:
        raise ProtocolError(f"chunk size must be positive, got {chunk_bytes}")
    count = -(-nbytes // chunk_bytes)
    if count >= 1 << CHUNK_INDEX_BITS:
        raise ProtocolError(f"{nbytes} bytes in {chunk_bytes}-byte chunks is too many chunks")
    return count
