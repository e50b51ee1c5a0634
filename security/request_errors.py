"""Refusals of a request by the security layer, importable without grpc (the coordinator core
counts them as it counts its own)."""


class Denied(Exception):
    """The peer's certificate does not allow this call."""


class MalformedRequest(ValueError):
    """Bytes that are not a valid message of the expected type."""
