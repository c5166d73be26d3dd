"""Control messages: every type round-trips through msgpack; bad payloads fail with a clear error."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from alignedserve.bus import messages as m
from alignedserve.bus.messages import (
    MESSAGE_TYPES,
    FinishReason,
    MessageError,
    SamplingSpec,
    TokenBatch,
    TokenEntry,
    UnknownMessageType,
    UnsupportedVersion,
    decode,
    encode,
)

LOC = m.KvLocation(worker_id="pool-0", kind=m.ServiceKind.KVPOOL, ucx_address_key="pool-0", handle="e17")
STATE = m.RequestState(
    gateway_id="gw-0",
    sampling=SamplingSpec(max_tokens=64, temperature=0.0, stop=("\n\n",), seed=7, logprobs=2),
    prompt_len=1500,
    output_len=3,
    recent_token_ids=(11, 12, 13),
    client_request_id="client-label-7",
)
PLANNED = m.PlannedRequest(
    request_id="r1", prefix_len=1503, blocks=94, location=LOC, state=STATE, arrival=10.5
)


def sample_messages() -> list[m.Message]:
    """One fully populated instance of every message type."""
    return [
        m.PrefillRequest(
            request_id="r1",
            model="smollm2",
            prompt_token_ids=tuple(range(1500)),
            sampling=STATE.sampling,
            arrival=1.25,
            gateway_id="gw-0",
            client_request_id="client-label-7",
        ),
        TokenBatch(
            worker_id="decode-0",
            iteration=41,
            entries=(
                TokenEntry(request_id="r1", first_index=3, token_ids=(5,), logprobs=(-0.25,)),
                TokenEntry(
                    request_id="r2",
                    first_index=9,
                    token_ids=(6, 7),
                    finish_reason=FinishReason.LENGTH,
                    logprobs=(-1.0, -2.0),
                    top_logprobs=(
                        m.TopLogprobs(token_ids=(6, 8), logprobs=(-1.0, -1.5)),
                        m.TopLogprobs(token_ids=(7, 9), logprobs=(-2.0, -2.5)),
                    ),
                ),
            ),
        ),
        m.KvReady(request_id="r1", prefix_len=1500, blocks=94, location=LOC, state=STATE, arrival=2.0),
        m.DecodeStatus(
            worker_id="decode-0",
            seq=12,
            free_blocks=300,
            total_blocks=4096,
            running=64,
            prefix_lo=1400,
            prefix_hi=1600,
            idle=False,
            candidate_requests=3,
            candidate_batch=60,
        ),
        m.BatchPlan(
            batch_id=8,
            decode_worker_id="decode-0",
            staging_worker_id="prefill-1",
            buffer=m.CandidateBuffer.BATCH,
            requests=(PLANNED,),
        ),
        m.PrefetchDone(
            batch_id=8,
            staging_worker_id="prefill-1",
            decode_worker_id="decode-0",
            buffer=m.CandidateBuffer.BATCH,
            ready=("r1",),
            failed=("r9",),
            location=LOC,
        ),
        m.CandidateBufferState(
            worker_id="prefill-1",
            seq=3,
            batch_ids=(8,),
            candidate_requests=("r4",),
            used_blocks=94,
            free_blocks=9,
        ),
        m.RequestEvicted(
            request_id="r1",
            decode_worker_id="decode-0",
            batch_id=8,
            to=m.CandidateBuffer.REQUESTS,
            prefix_len=1600,
            blocks=100,
            location=LOC,
            state=STATE,
            arrival=2.0,
        ),
        m.RequestFinished(
            request_id="r1",
            worker_id="decode-0",
            finish_reason=FinishReason.STOP,
            prompt_tokens=1500,
            completion_tokens=20,
        ),
        m.Cancel(request_id="r1"),
        m.RequestLost(request_id="r1", worker_id="decode-0", reason="KV pull failed: peer gone"),
        m.WorkerHeartbeat(
            kind=m.ServiceKind.KVPOOL,
            worker_id="kvpool-0",
            state=m.WorkerState.READY,
            seq=1,
            ucx_address=b"\x00\x01ucx-address\xff",
            http_url="http://127.0.0.1:9101",
            started_at=100.0,
            kv_used_bytes=3 << 20,
            kv_capacity_bytes=1 << 30,
        ),
    ]


def test_every_registered_type_has_a_sample_and_a_unique_wire_name() -> None:
    assert {type(msg) for msg in sample_messages()} == set(MESSAGE_TYPES)
    assert len({cls.TYPE for cls in MESSAGE_TYPES}) == len(MESSAGE_TYPES)
    assert all(cls.VERSION >= 1 for cls in MESSAGE_TYPES)


@pytest.mark.parametrize("message", sample_messages(), ids=lambda msg: msg.TYPE)
def test_round_trip_is_exact(message: m.Message) -> None:
    payload = encode(message)
    back = decode(payload)
    assert back == message
    assert type(back) is type(message)
    assert back.message_id == message.message_id


def test_message_ids_are_unique_unless_set() -> None:
    a, b = m.Cancel(request_id="r"), m.Cancel(request_id="r")
    assert a.message_id != b.message_id
    assert m.Cancel(request_id="r", message_id="fixed").message_id == "fixed"


def test_float_field_accepts_an_integer_on_the_wire() -> None:
    msg = m.Cancel(request_id="r", created_at=5.0)
    raw = msgpack.unpackb(encode(msg))
    raw[2][1] = 5  # created_at as a msgpack int
    assert decode(msgpack.packb(raw)).created_at == 5.0


def test_unknown_type_fails_clearly() -> None:
    with pytest.raises(UnknownMessageType, match="'no_such_message'"):
        decode(msgpack.packb(["no_such_message", 1, []]))


def test_other_version_fails_clearly() -> None:
    raw = msgpack.unpackb(encode(m.Cancel(request_id="r")))
    raw[1] = 2
    with pytest.raises(UnsupportedVersion, match=r"cancel schema v2 .* speaks v1"):
        decode(msgpack.packb(raw))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda body: body.append("extra"), "Cancel has 4 fields, got 5"),
        (lambda body: body.pop(), "Cancel has 4 fields, got 3"),
        (lambda body: body.__setitem__(2, 42), r"Cancel.request_id: expected str, got int"),
        (lambda body: body.__setitem__(1, "soon"), r"Cancel.created_at: expected float, got str"),
    ],
)
def test_malformed_body_names_the_field(mutate: object, match: str) -> None:
    raw = msgpack.unpackb(encode(m.Cancel(request_id="r")))
    mutate(raw[2])  # type: ignore[operator]
    with pytest.raises(MessageError, match=match):
        decode(msgpack.packb(raw))


def test_nested_errors_name_the_path() -> None:
    batch = TokenBatch(
        worker_id="d", iteration=0, entries=(TokenEntry(request_id="r", first_index=0, token_ids=(1,)),)
    )
    raw = msgpack.unpackb(encode(batch))
    raw[2][4][0][2] = [1, "two"]  # entries[0].token_ids[1]
    with pytest.raises(
        MessageError, match=r"TokenBatch.entries: \[0\]: TokenEntry.token_ids: \[1\]: expected int"
    ):
        decode(msgpack.packb(raw))


def test_bad_enum_value_lists_the_allowed_ones() -> None:
    hb = m.WorkerHeartbeat(kind=m.ServiceKind.GATEWAY, worker_id="g", state=m.WorkerState.READY, seq=0)
    raw = msgpack.unpackb(encode(hb))
    raw[2][2] = "router"
    with pytest.raises(MessageError, match="'router' is not one of 'gateway'"):
        decode(msgpack.packb(raw))


@pytest.mark.parametrize(
    "payload", [b"", b"\xc1", msgpack.packb({"t": "cancel"}), msgpack.packb(["cancel", "1", []])]
)
def test_garbage_is_a_message_error(payload: bytes) -> None:
    with pytest.raises(MessageError):
        decode(payload)


def test_unregistered_subclass_cannot_be_encoded() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Rogue(m.Message):
        TYPE = "cancel"  # pretends to be another type

    with pytest.raises(MessageError, match="not a registered"):
        encode(Rogue())


def test_routing_keys_keep_related_messages_together() -> None:
    by_type = {type(msg): msg.routing_key() for msg in sample_messages()}
    assert by_type[m.PrefillRequest] == "r1"
    assert by_type[TokenBatch] == "decode-0"
    assert by_type[m.BatchPlan] == "decode-0"
    assert by_type[m.WorkerHeartbeat] == "kvpool-0"


def test_token_batch_stays_small() -> None:
    entries = tuple(
        TokenEntry(request_id=f"req-{i:08d}", first_index=100, token_ids=(31_000,)) for i in range(128)
    )
    payload = encode(TokenBatch(worker_id="decode-0", iteration=1, entries=entries))
    assert len(payload) < 128 * 24  # ~20 bytes per request per iteration
    assert len(encode(m.Cancel(request_id="r1"))) < 96
