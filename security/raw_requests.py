"""Requests decoded by geodiloco rather than by gRPC, so malformed bytes get a clear status.

gRPC's own deserializer answers undecodable bytes with UNKNOWN and a Python exception text.
Here every method receives raw bytes and decodes them with :func:`decode`; a failure becomes
INVALID_ARGUMENT with a message and one log line. Oversized messages never get this far: gRPC
refuses them with RESOURCE_EXHAUSTED (``grpc.max_receive_message_length``) before buffering them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from geodiloco.security.request_errors import MalformedRequest

log = logging.getLogger("geodiloco.coordinator")


M = TypeVar("M", bound=Message)


def decode(cls: type[M], data: bytes) -> M:
    """Parse ``data`` as ``cls``; any failure is a MalformedRequest naming the type."""
    try:
        return cls.FromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MalformedRequest(f"malformed {cls.DESCRIPTOR.name} ({len(data)} bytes): {exc}") from None


BULK_FIELD = "payload"  # a streamed message's megabyte-sized bytes field, left unparsed


class CutMessage:
    """A message parsed without its bulk bytes field, which stays a view of the received bytes
    (:attr:`payload`, the field's value); every other field reads through to :attr:`message`.

    Parsing a push chunk whole copied its payload into the message, and each of the two reads
    of ``payload`` copied it out again: three copies of every pushed byte on the coordinator,
    two of them on its event loop."""

    __slots__ = ("message", "payload")

    def __init__(self, message: Message, payload: memoryview) -> None:
        self.message, self.payload = message, payload

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_with(head: Message, payload: bytes | memoryview, field: str = BULK_FIELD) -> bytes:
    """``head`` (its bulk field unset) encoded with ``payload`` appended as that field. Parsers
    take fields in any order; the payload is copied once, where setting the field, measuring
    the message and serializing it copied it three times."""
    if not payload:
        return head.SerializeToString()
    tag = varint(head.DESCRIPTOR.fields_by_name[field].number << 3 | 2)
    return b"".join((head.SerializeToString(), tag, varint(len(payload)), payload))


def _read_varint(data: bytes, at: int) -> tuple[int, int] | None:
    """The varint at ``data[at:]`` and the offset after it; None if it runs off the end."""
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return None


def cut_field(data: bytes, number: int) -> tuple[bytes, memoryview] | None:
    """``data`` (a serialized message) without its top-level length-delimited field ``number``,
    and that field's value (the last, as a parser takes it) as a view of ``data``. None where the
    field is absent or the bytes do not scan as top-level fields: the whole parse then takes
    them and names any fault."""
    view = memoryview(data)
    kept: list[memoryview] = []
    value: memoryview | None = None
    at, end = 0, len(data)
    while at < end:
        start = at
        key = _read_varint(data, at)
        if key is None:
            return None
        tag, at = key
        wire = tag & 7
        if wire == 0:
            skipped = _read_varint(data, at)
            if skipped is None:
                return None
            at = skipped[1]
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        elif wire == 2:
            length = _read_varint(data, at)
            if length is None:
                return None
            at = length[1] + length[0]
            if at <= end and tag >> 3 == number:
                value = view[length[1] : at]
                continue
        else:  # groups: not in this protocol
            return None
        if at > end:
            return None
        kept.append(view[start:at])
    return None if value is None else (b"".join(kept), value)


def decode_cut(cls: type[M], data: bytes, field: str = BULK_FIELD) -> M:
    """Parse ``data`` as ``cls`` with ``field`` (bytes) left unparsed where it can be: a
    :class:`CutMessage`, or the plain message where the field is absent or the bytes are odd.
    Typed as ``cls``: a cut message reads as one (its payload a view rather than bytes)."""
    cut = cut_field(data, cls.DESCRIPTOR.fields_by_name[field].number)
    if cut is None:
        return decode(cls, data)
    rest, value = cut
    try:
        return cast(M, CutMessage(cls.FromString(rest), value))
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MalformedRequest(f"malformed {cls.DESCRIPTOR.name} ({len(data)} bytes): {exc}") from None


class DecodedStream:
    """A client stream's messages, decoded as they are read (a message with a bulk field, cut:
    :func:`decode_cut`). ``last_size`` is the wire size of the message read last: byte counts
    come from what arrived, not from re-encoding a megabyte-sized message to measure it."""

    def __init__(self, cls: type[Message], raw: AsyncIterator[bytes]) -> None:
        self._cls, self._raw = cls, raw
        self._cut = BULK_FIELD in cls.DESCRIPTOR.fields_by_name
        self.last_size = 0

    def __aiter__(self) -> DecodedStream:
        return self

    async def __anext__(self) -> Message:
        data = await anext(self._raw)
        self.last_size = len(data)
        return decode_cut(self._cls, data) if self._cut else decode(self._cls, data)


def wire_size(stream: AsyncIterator[Message], message: Message) -> int:
    """The wire size of ``message``, just read from ``stream``."""
    return stream.last_size if isinstance(stream, DecodedStream) else message.ByteSize()


def _serializer(cls: type[Message]) -> Callable[[Any], bytes]:
    """Serialize a response message; bytes (a message the servicer encoded itself, e.g. an
    update chunk joined with its shared payload) pass as they are."""
    serialize = cls.SerializeToString

    def to_bytes(message: Any) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return to_bytes


async def _refuse(context: grpc.aio.ServicerContext, rpc: str, exc: MalformedRequest) -> None:
    log.warning("[%s] peer=%s refused (INVALID_ARGUMENT): %s", rpc, context.peer(), exc)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _handler(rpc: str, method: Any, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    request_cls = message_factory.GetMessageClass(method.input_type)
    serialize = _serializer(message_factory.GetMessageClass(method.output_type))
    if method.client_streaming:

        async def stream_in(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            return await behavior(DecodedStream(request_cls, raw), context)

        return grpc.stream_unary_rpc_method_handler(stream_in, response_serializer=serialize)
    if method.server_streaming:

        async def stream_out(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                request = decode(request_cls, data)
            except MalformedRequest as exc:
                await _refuse(context, rpc, exc)
            async for response in behavior(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream_out, response_serializer=serialize)

    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = decode(request_cls, data)
        except MalformedRequest as exc:
            await _refuse(context, rpc, exc)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serialize)


def strict_service(service: ServiceDescriptor, servicer: object) -> grpc.GenericRpcHandler:
    """A handler for ``service`` that routes every method to ``servicer`` with strict decoding."""
    handlers = {
        m.name: _handler(f"{service.name}.{m.name}", m, getattr(servicer, m.name)) for m in service.methods
    }
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
