"""Requests decoded by geodiloco rather than by gRPC, so malformed bytes get a clear status.

gRPC's own deserializer answers undecodable bytes with UNKNOWN and a Python exception text.
Here every method receives raw bytes and decodes them with :func:`decode`; a failure becomes
INVALID_ARGUMENT with a message and one log line. Oversized messages never get this far: gRPC
refuses them with RESOURCE_EXHAUSTED (``grpc.max_receive_message_length``) before buffering them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

log = logging.getLogger("geodiloco.coordinator")


class MalformedRequest(ValueError):
    """Bytes that are not a valid message of the expected type."""


def decode(cls: type[Message], data: bytes) -> Any:
    """Parse ``data`` as ``cls``; any failure is a MalformedRequest naming the type."""
    try:
        return cls.FromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MalformedRequest(f"malformed {cls.DESCRIPTOR.name} ({len(data)} bytes): {exc}") from None


class DecodedStream:
    """A client stream's messages, decoded as they are read. ``last_size`` is the wire size of
    the message read last: byte counts come from what arrived, not from re-encoding a
    megabyte-sized message on the event loop to measure it."""

    def __init__(self, cls: type[Message], raw: AsyncIterator[bytes]) -> None:
        self._cls, self._raw = cls, raw
        self.last_size = 0

    def __aiter__(self) -> DecodedStream:
        return self

    async def __anext__(self) -> Any:
        data = await anext(self._raw)
        self.last_size = len(data)
        return decode(self._cls, data)


def wire_size(stream: AsyncIterator[Any], message: Message) -> int:
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
