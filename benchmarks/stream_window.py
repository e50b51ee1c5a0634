"""Whether one gRPC stream is held back by its flow-control window on a long path.

Run:  .venv/bin/python benchmarks/stream_window.py --json runs/stream_window.json

A gRPC server streams ``--mb`` megabytes in 4 MiB messages (as a pull does) to a client behind a
``geodiloco wan`` proxy, once per one-way latency in ``--latency-ms``; the proxy's buffer is
large (``--buffer-mb``) so that only HTTP/2's end-to-end flow control (its WINDOW_UPDATEs cross
the emulated latency) can limit the stream. A window-limited stream would slow down in
proportion to the round trip. TCP's own window is not emulated: each of the proxy's hops is
local. Printed and written per latency: megabytes per second and gigabits per second.

``--smoke`` (8 MB, latencies 0 and 50 ms) only checks that the benchmark still runs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from geodiloco.app.wan import LinkConfig, ProxyThread

MESSAGE_BYTES = 4 << 20
LIMIT = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _identity(data: bytes) -> bytes:
    return data


def serve(messages: int) -> tuple[grpc.Server, int]:
    payload = b"\x5a" * MESSAGE_BYTES

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in range(messages):
            yield payload

    handler = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=_identity, response_serializer=_identity
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), options=LIMIT)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Window", {"Stream": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def measure(port: int, latency_ms: float, buffer_bytes: int) -> dict[str, Any]:
    link = LinkConfig(latency_ms=latency_ms, buffer_bytes=buffer_bytes)
    with ProxyThread(f"127.0.0.1:{port}", link) as proxy:
        channel = grpc.insecure_channel(proxy.address, options=LIMIT)
        call = channel.unary_stream(
            "/bench.Window/Stream", request_serializer=_identity, response_deserializer=_identity
        )
        sum(len(m) for m in call(b""))  # the connection up and its windows grown, as on a long run
        began = time.perf_counter()
        received = sum(len(m) for m in call(b""))
        seconds = time.perf_counter() - began
        channel.close()
    return {
        "latency_ms": latency_ms,
        "bytes": received,
        "seconds": round(seconds, 3),
        "mb_per_s": round(received / seconds / 1e6, 1),
        "gbit_per_s": round(received * 8 / seconds / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="megabytes per stream (4 MiB messages)")
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 25.0, 50.0], help="one way")
    parser.add_argument("--buffer-mb", type=int, default=256, help="the proxy's buffer per direction")
    parser.add_argument("--smoke", action="store_true", help="8 MB at 0 and 50 ms: seconds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.latency_ms = 8, [0.0, 50.0]
    server, port = serve(max(1, (args.mb << 20) // MESSAGE_BYTES))
    rows = []
    try:
        for latency in args.latency_ms:
            row = measure(port, latency, args.buffer_mb << 20)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        server.stop(0)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
