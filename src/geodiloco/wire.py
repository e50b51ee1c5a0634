"""Conversions between protocol messages and the Python types both ends use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from geodiloco.v1 import outer_sync_pb2
from geodiloco.workload.data import DataRange

# Call metadata naming the site that opens a push stream, so the coordinator holds its lease
# from the first byte (plaintext loopback runs; with mTLS the certificate names the site).
PUSHER_KEY = "geodiloco-site"


def ranges_to_proto(data: Iterable[DataRange]) -> list[Any]:
    return [outer_sync_pb2.DataRange(shard=d.shard, start=d.start, end=d.end, epoch=d.epoch) for d in data]


def ranges_from_proto(data: Iterable[Any]) -> list[DataRange]:
    return [DataRange(d.shard, d.start, d.end, d.epoch) for d in data]
