"""msgpack encoding of the frozen dataclasses in `messages.py`, checked field by field on decode.

Wire form of one message: the msgpack array ``[type_name, schema_version, body]``; ``body`` (and every
nested struct) is the array of its fields in declaration order, tuples are arrays, enums their string
values. Positional arrays keep a 128-request token batch small and fast; the schema version in the
envelope is what makes the field order safe to change. Encoders and decoders are compiled once per class
from its type hints; decoding checks arity and every value's type, so a malformed payload fails with a
`MessageError` naming the message and field, never with a half-built object.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any

import msgpack


class MessageError(ValueError):
    """A payload that is not a valid control message of this build."""


class UnknownMessageType(MessageError):
    """The envelope names a message type this build does not define."""


class UnsupportedVersion(MessageError):
    """The envelope's schema version differs from the one this build speaks."""


Encoder = Callable[[Any], Any]  # typed value -> msgpack-ready value
Decoder = Callable[[Any], Any]  # raw value -> typed value; raises MessageError("where: what")


def _identity(value: Any) -> Any:
    return value  # primitives, and tuples of primitives (msgpack packs tuples as arrays)


_PRIMITIVES = (int, float, str, bool, bytes)


def _is_plain(hint: Any) -> bool:
    """True when values of this type need no conversion to be packed."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return all(a is type(None) or _is_plain(a) for a in typing.get_args(hint))
    if origin is tuple:
        return _is_plain(typing.get_args(hint)[0])
    return hint in _PRIMITIVES


def _encoder_for(hint: Any) -> Encoder:
    if _is_plain(hint):
        return _identity
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        inner = _encoder_for(_optional_arg(hint))
        return lambda v: None if v is None else inner(v)
    if origin is tuple:
        item = _encoder_for(typing.get_args(hint)[0])
        return lambda v: [item(x) for x in v]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: v.value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return struct_encoder(hint)
    raise TypeError(f"unsupported type on the wire: {hint}")


def _optional_arg(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) != 1:
        raise TypeError(f"unsupported union on the wire: {hint}")
    return args[0]


def _primitive(kind: type) -> Decoder:
    def decode(raw: Any) -> Any:
        if type(raw) is kind:
            return raw
        if kind is float and type(raw) is int:
            return float(raw)  # msgpack keeps 1 and 1.0 apart; a float field takes both
        raise MessageError(f"expected {kind.__name__}, got {type(raw).__name__}")

    return decode


def _tuple_of_primitive(kind: type) -> Decoder:
    scalar = _primitive(kind)

    def decode(raw: Any) -> tuple[Any, ...]:
        if type(raw) is not tuple:
            raise MessageError(f"expected an array, got {type(raw).__name__}")
        if all(type(x) is kind for x in raw):
            return raw  # already a tuple (unpacked with use_list=False)
        return _decode_items(scalar, raw)

    return decode


def _decode_items(item: Decoder, raw: tuple[Any, ...]) -> tuple[Any, ...]:
    out = []
    for i, x in enumerate(raw):
        try:
            out.append(item(x))
        except MessageError as exc:
            raise MessageError(f"[{i}]: {exc}") from None
    return tuple(out)


def _tuple_of(item: Decoder) -> Decoder:
    def decode(raw: Any) -> tuple[Any, ...]:
        if type(raw) is not tuple:
            raise MessageError(f"expected an array, got {type(raw).__name__}")
        return _decode_items(item, raw)

    return decode


def _optional(inner: Decoder) -> Decoder:
    return lambda raw: None if raw is None else inner(raw)


def _enum(kind: type[enum.Enum]) -> Decoder:
    def decode(raw: Any) -> enum.Enum:
        try:
            return kind(raw)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in kind)
            raise MessageError(f"{raw!r} is not one of {allowed}") from None

    return decode


def _decoder_for(hint: Any) -> Decoder:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return _optional(_decoder_for(_optional_arg(hint)))
    if origin is tuple:
        item, ellipsis = typing.get_args(hint)
        if ellipsis is not Ellipsis:
            raise TypeError(f"wire tuples are homogeneous tuple[T, ...], got {hint}")
        return _tuple_of_primitive(item) if item in _PRIMITIVES else _tuple_of(_decoder_for(item))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return struct_decoder(hint)
    if hint in _PRIMITIVES:
        return _primitive(hint)
    raise TypeError(f"unsupported type on the wire: {hint}")


def _wire_fields(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


_ENCODERS: dict[type, Encoder] = {}
_DECODERS: dict[type, Decoder] = {}


def struct_encoder(cls: type) -> Encoder:
    """obj -> [field values in declaration order] (compiled once per class)."""
    if cls not in _ENCODERS:
        _ENCODERS[cls] = _compile_encoder(cls)
    return _ENCODERS[cls]


def struct_decoder(cls: type) -> Decoder:
    """[field values] -> obj, checking arity and each field's type (compiled once per class)."""
    if cls not in _DECODERS:
        _DECODERS[cls] = _compile_decoder(cls)
    return _DECODERS[cls]


def _compile_encoder(cls: type) -> Encoder:
    fields = [(name, _encoder_for(hint)) for name, hint in _wire_fields(cls)]

    def encode(obj: Any) -> list[Any]:
        return [enc(getattr(obj, name)) for name, enc in fields]

    return encode


def _compile_decoder(cls: type) -> Decoder:
    names = [name for name, _ in _wire_fields(cls)]
    decoders = [_decoder_for(hint) for _, hint in _wire_fields(cls)]
    arity = len(names)

    def name_the_bad_field(raw: tuple[Any, ...]) -> MessageError:
        for name, dec, value in zip(names, decoders, raw, strict=True):
            try:
                dec(value)
            except MessageError as exc:
                return MessageError(f"{cls.__name__}.{name}: {exc}")
        return MessageError(f"invalid {cls.__name__}")

    def decode(raw: Any) -> Any:
        if type(raw) is not tuple or len(raw) != arity:
            got = f"{len(raw)} fields" if type(raw) is tuple else type(raw).__name__
            raise MessageError(f"{cls.__name__} has {arity} fields, got {got}")
        try:  # fast path: no per-field bookkeeping; on error, re-walk to say which field
            values = [dec(value) for dec, value in zip(decoders, raw, strict=True)]
        except MessageError:
            raise name_the_bad_field(raw) from None
        try:
            return cls(**dict(zip(names, values, strict=True)))
        except (TypeError, ValueError) as exc:
            raise MessageError(f"invalid {cls.__name__}: {exc}") from exc

    return decode


def pack(type_name: str, version: int, body: list[Any]) -> bytes:
    packed: bytes = msgpack.packb((type_name, version, body), use_bin_type=True)
    return packed


def unpack_envelope(payload: bytes) -> tuple[str, int, Any]:
    try:
        raw = msgpack.unpackb(payload, raw=False, use_list=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise MessageError(f"not a msgpack control message: {exc}") from exc
    if not (type(raw) is tuple and len(raw) == 3):
        raise MessageError("control message envelope must be [type, version, body]")
    type_name, version, body = raw
    if type(type_name) is not str or type(version) is not int:
        raise MessageError(f"malformed envelope: type={type_name!r} version={version!r}")
    return type_name, version, body
