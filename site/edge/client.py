"""The site's gRPC client for the outer loop (blocking; one per rank of the site).

Unary calls are retried by gRPC itself (service-config retry policy on UNAVAILABLE); joins,
pushes and pulls are retried here with jittered exponential backoff, which is safe because the
coordinator treats a repeated push for the same (run, round, fragment, site) as a no-op.

A coordinator that dies mid-call ends the call with whatever its transport says: UNAVAILABLE
after a SIGKILL, but UNKNOWN, CANCELLED or a transport INTERNAL when the process went down by
an exception. All of these are retried (see :func:`transient`), until the coordinator is back,
for up to ``patience_s``; a refusal the coordinator means (INVALID_ARGUMENT, PERMISSION_DENIED,
FAILED_PRECONDITION, ...) is raised at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch
from google.protobuf.message import Message

from geodiloco import __version__, faults
from geodiloco.compression import CodecError, EncodedChunk, decode_chunks_into, parse_pipeline
from geodiloco.exchange import (
    ChunkSink,
    JoinInfo,
    PulledPart,
    PushPart,
    RoundReport,
    StreamFacts,
    WireChunk,
    without_payload,
)
from geodiloco.progress import Progress
from geodiloco.security.chunks import KeyMismatch, open_update, sealed_delta_payload
from geodiloco.security.joinproof import join_proof
from geodiloco.security.raw_requests import decode_cut, encode_with
from geodiloco.security.sealing import SiteKeys
from geodiloco.security.tls import TlsFiles, open_channel
from geodiloco.v1 import outer_sync_pb2, outer_sync_pb2_grpc
from geodiloco.wire import PUSHER_KEY, join_info_from_proto, push_messages, ranges_from_proto, report_to_proto
from geodiloco.workload.data import DataRange

log = logging.getLogger("geodiloco.site")

MAX_MESSAGE_BYTES = 32 * 1024 * 1024
_RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": "geodiloco.v1.OuterSync", "method": m}
                    for m in ("Join", "Heartbeat", "Report", "Leave")
                ],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
CONNECTION_ARG = "geodiloco.connection"  # a channel argument of ours: channels differing in it
# get a connection each
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # back within a second of a coordinator restart: every site waits for the last one to return
    # (a dial a second to a dead coordinator costs nothing)
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", _RETRY_SERVICE_CONFIG),
]
UNARY_TIMEOUT_S = 30.0
_SERVICE = outer_sync_pb2.DESCRIPTOR.services_by_name["OuterSync"].full_name
PUSH_METHOD = f"/{_SERVICE}/PushDelta"
PULL_METHOD = f"/{_SERVICE}/PullUpdate"
PATIENCE_S = 120.0  # until the run's own (round_timeout_s) is known
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,  # the coordinator's process ended by an exception mid-call
    grpc.StatusCode.CANCELLED,  # ... and cancelled its open calls on the way out
)
# INTERNAL is a refusal when the coordinator says it (CoordinatorError), a lost call when the
# transport says it: a stream reset or cut short by the peer's death
TRANSPORT_FAILURES = ("RST_STREAM", "Stream removed", "GOAWAY", "Socket closed", "Connection reset", "EOS")
OWN_FAILURE = "Exception iterating requests"  # our own request iterator raised: no retry helps


def transient(exc: grpc.RpcError) -> bool:
    """Whether a failed call is worth repeating: the coordinator (or the path to it) went away or
    timed out, rather than refusing the call."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INTERNAL:
        return any(marker in details for marker in TRANSPORT_FAILURES)
    return code in RETRYABLE and not details.startswith(OWN_FAILURE)


T = TypeVar("T")
M = TypeVar("M", bound=Message)


def _as_is(message: bytes) -> bytes:
    """A request the client encoded itself."""
    return message


def delta_messages(
    run_id: str,
    site: str,
    round_: int,
    codec: str,
    chunks: Sequence[WireChunk | EncodedChunk],
    tokens: int,
    data: list[DataRange] | None = None,
    part: int = 0,
    parts: int = 1,
    fragment: int = 0,
) -> list[outer_sync_pb2.DeltaChunk]:
    """The whole PushDelta stream of one part, payloads in place (tests and third-party tools
    that send raw messages); the client itself streams :func:`~geodiloco.wire.push_messages`."""
    messages = []
    for head, payload in push_messages(
        run_id, site, PushPart(fragment, round_, codec, chunks, tokens, data, part, parts)
    ):
        head.payload = bytes(payload)
        messages.append(head)
    return messages


class OuterSyncClient:
    """One site's connection to the coordinator; counts the bytes it sends and receives.

    With ``tls`` the channel is mutual TLS; with ``site_secret`` every pushed chunk is sealed and
    every pulled chunk opened with this site's keys for the run (known after ``join``). Clients
    of one process share a TCP connection to the same target unless their ``connection``
    numbers differ (gRPC pools connections by channel arguments).
    """

    def __init__(
        self,
        target: str,
        site: str,
        *,
        tls: TlsFiles | None = None,
        site_secret: bytes | None = None,
        max_attempts: int = 8,
        patience_s: float = PATIENCE_S,
        connection: int = 0,
    ) -> None:
        self.site = site
        self.rank = int(os.environ.get("RANK", "0"))  # the site's rank (fault plans place by it)
        self.run_id = ""
        self.assigned: list[DataRange] = []  # the ledger's data for this site, as last told
        self.max_attempts = max_attempts
        self.patience_s = patience_s  # how long a lost call is retried (and at least max_attempts)
        self.keys: SiteKeys | None = None
        self._site_secret = site_secret
        options = CHANNEL_OPTIONS + ([(CONNECTION_ARG, connection)] if connection else [])
        self.channel = open_channel(target, tls, options=options)
        self.stub = outer_sync_pb2_grpc.OuterSyncStub(self.channel)
        # the bulk streams, encoded and decoded here rather than by the stub (see _update_chunk)
        self._push_encoded = self.channel.stream_unary(
            PUSH_METHOD, request_serializer=_as_is, response_deserializer=outer_sync_pb2.PushAck.FromString
        )
        self._pull_cut = self.channel.unary_stream(
            PULL_METHOD,
            request_serializer=outer_sync_pb2.PullRequest.SerializeToString,
            response_deserializer=self._update_chunk,
        )
        self.bytes_sent = 0
        self.bytes_received = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        self.channel.close()

    def _count(self, sent: Message | None = None, received: Message | None = None) -> None:
        self._count_bytes(
            sent.ByteSize() if sent is not None else 0, received.ByteSize() if received is not None else 0
        )

    def _count_bytes(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _update_chunk(self, data: bytes) -> outer_sync_pb2.UpdateChunk:
        """A pulled message, counted as it arrived and parsed with its payload left a view of
        ``data`` (:func:`~geodiloco.security.raw_requests.decode_cut`): not re-encoded to measure it, and
        its payload copied once (out of ``data``) instead of into the message and out again."""
        self._count_bytes(received=len(data))
        chunk: outer_sync_pb2.UpdateChunk = decode_cut(outer_sync_pb2.UpdateChunk, data)
        return chunk

    def _unary(self, method: Callable[..., M], request: Message) -> M:
        self._count(sent=request)
        response = method(request, timeout=UNARY_TIMEOUT_S, wait_for_ready=True)
        self._count(received=response)
        return response

    def _with_backoff(self, what: str, attempt_fn: Callable[[], T]) -> T:
        """Repeat a call that failed transiently: at least ``max_attempts`` tries, and for
        ``patience_s`` since the first failure (each try waits for the channel to be ready, so
        a coordinator being restarted is waited for, not hammered)."""
        delay, attempt, first_failure = 0.2, 0, 0.0
        while True:
            attempt += 1
            try:
                return attempt_fn()
            except grpc.RpcError as exc:
                now = time.monotonic()
                first_failure = first_failure or now
                patient = attempt < self.max_attempts or now - first_failure < self.patience_s
                if not transient(exc) or not patient:
                    raise
                log.warning(
                    "%s failed (%s %s), retry %d in %.1fs",
                    what,
                    exc.code().name,
                    exc.details(),
                    attempt,
                    delay,
                )
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 5.0)

    # -- RPCs -------------------------------------------------------------------------------

    def join(self, state_hash: str = "", world_size: int = 1, run_id: str = "") -> JoinInfo:
        """Join the run; a coordinator that is not up yet is waited for with backoff."""
        request = outer_sync_pb2.JoinRequest(
            run_id=run_id, site=self.site, state_hash=state_hash, world_size=world_size, version=__version__
        )
        if self._site_secret is not None:  # admitted only once it proves its secret
            request.key_proof = join_proof(self._site_secret, run_id, self.site, world_size)
        r = self._with_backoff("join", lambda: self._unary(self.stub.Join, request))
        self.run_id = r.run_id
        self.patience_s = _round_timeout(r.run_config_json) or self.patience_s
        self.assigned = ranges_from_proto(r.data)
        self.keys = self._keys_for(r.run_id, r.key_id)
        return join_info_from_proto(r)

    def _keys_for(self, run_id: str, key_id: int) -> SiteKeys | None:
        """This site's keys for the run, checked against the key id the coordinator expects."""
        if self._site_secret is None:
            if key_id:
                raise KeyMismatch("the coordinator seals payloads; give this site its secret (--secret)")
            return None
        if not key_id:
            raise KeyMismatch("the coordinator does not seal payloads; refusing to send them in the clear")
        keys = SiteKeys.derive(self._site_secret, run_id)
        if keys.key_id != key_id:
            raise KeyMismatch(
                f"this site's secret gives key id {keys.key_id:08x}, the run expects {key_id:08x}: "
                "the secret belongs to another run secret or another site"
            )
        return keys

    def heartbeat(self, round_: int) -> outer_sync_pb2.HeartbeatResponse:
        return self._unary(
            self.stub.Heartbeat,
            outer_sync_pb2.HeartbeatRequest(run_id=self.run_id, site=self.site, round=round_),
        )

    def report(
        self,
        round_: int,
        digest: str,
        eval_loss_sum: float,
        eval_count: int,
        train_loss: float,
        tokens: int,
        compute_seconds: float,
        fragment: int = 0,
    ) -> outer_sync_pb2.ReportResponse:
        """:meth:`send_report` spelled out."""
        report = RoundReport(
            fragment, round_, digest, eval_loss_sum, eval_count, train_loss, tokens, compute_seconds
        )
        return self.send_report(report)

    def send_report(self, report: RoundReport) -> outer_sync_pb2.ReportResponse:
        """The site's hash of a fragment after a round, and its metrics."""
        return self._unary(self.stub.Report, report_to_proto(self.run_id, self.site, report))

    def leave(self, reason: str = "") -> None:
        self._unary(
            self.stub.Leave, outer_sync_pb2.LeaveRequest(run_id=self.run_id, site=self.site, reason=reason)
        )

    def adopt(self, run_id: str, key_id: int) -> None:
        """Act in a run another rank of this site joined (this rank pushes and pulls its part)."""
        self.run_id = run_id
        self.keys = self._keys_for(run_id, key_id)

    def push(
        self,
        round_: int,
        codec: str,
        chunks: Sequence[WireChunk | EncodedChunk],
        tokens: int,
        data: list[DataRange] | None = None,
        timeout_s: float = 600.0,
        part: int = 0,
        parts: int = 1,
        fragment: int = 0,
    ) -> outer_sync_pb2.PushAck:
        """:meth:`push_part` spelled out (``data`` None: the data the coordinator last assigned)."""
        pushed = PushPart(fragment, round_, codec, chunks, tokens, data, part, parts)
        return self.push_part(pushed, timeout_s=timeout_s)

    def push_part(self, part: PushPart, timeout_s: float = 600.0) -> outer_sync_pb2.PushAck:
        """Stream one part of a fragment round's pseudo-gradient; retried as a whole (pushes are
        idempotent). ``part.data`` None sends the data the coordinator last assigned."""
        if part.data is None:
            part = dataclasses.replace(part, data=self.assigned)
        if not part.chunks:
            raise ValueError("a push part needs at least one chunk")

        def messages() -> Iterator[bytes]:  # consumed by gRPC's sender thread: sealing overlaps sending
            sent = 0
            for head, payload in push_messages(self.run_id, self.site, part):
                faults.at(self.site, self.rank, part.round, sent, "push")  # tests: mid-push faults
                if self.keys is not None:
                    payload = sealed_delta_payload(self.keys.up, head, payload)
                message = encode_with(head, payload)
                self._count_bytes(sent=len(message))
                yield message
                sent += 1
            faults.at(self.site, self.rank, part.round, sent, "push")  # all sent, not yet acknowledged

        def attempt() -> outer_sync_pb2.PushAck:
            # the site named up front: its lease is held from the stream's first byte, not from
            # its first whole chunk (one chunk can outlast a lease on a slow link)
            ack: outer_sync_pb2.PushAck = self._push_encoded(
                messages(), timeout=timeout_s, wait_for_ready=True, metadata=((PUSHER_KEY, self.site),)
            )
            self._count(received=ack)
            return ack

        return self._with_backoff(f"push of {_name(part.fragment, part.round)}", attempt)

    def pull(
        self,
        round_: int,
        full_state: bool = False,
        timeout_s: float = 900.0,
        part: int = 0,
        parts: int = 1,
        fragment: int = 0,
        on_chunk: ChunkSink | None = None,
        keep_payloads: bool = True,
    ) -> PulledPart:
        """This puller's share of the update closing ``round_`` (waits for its commit), or of the
        full current state: the chunks with ``seq % parts == part``, opened but not decoded.

        ``on_chunk(seq, chunk, facts)`` is called with each chunk as it arrives, on this thread,
        so that decoding overlaps the chunks still on the wire. A retried stream calls it again
        for the chunks it brings again, possibly under other facts (an update no longer kept
        comes back as the full state): key what it does by facts and ``seq``.

        ``keep_payloads=False`` (with ``on_chunk``): the sink is the payloads' only reader, and
        the returned chunks keep their elements but not their bytes. Each payload is freed once
        the sink has it, instead of a share of the model held until the pull ends; freeing them
        all at once then gives the pages back to the kernel, and the next pull's buffers take
        fresh ones, which the kernel must zero (7% of a synthetic site's CPU time at 500M
        parameters, ``benchmarks/scale.py`` under ``perf record -a``)."""
        if not keep_payloads and on_chunk is None:
            raise ValueError("keep_payloads=False needs an on_chunk sink: nothing would read the payloads")
        kind = outer_sync_pb2.PullRequest.FULL_STATE if full_state else outer_sync_pb2.PullRequest.UPDATE
        request = outer_sync_pb2.PullRequest(
            run_id=self.run_id,
            site=self.site,
            round=round_,
            kind=kind,
            part=part,
            parts=parts,
            fragment=fragment,
        )

        def attempt() -> PulledPart:
            self._count(sent=request)
            chunks: dict[int, EncodedChunk] = {}
            last: outer_sync_pb2.UpdateChunk | None = None
            shown: Progress | None = None
            stream = self._pull_cut(request, timeout=timeout_s, wait_for_ready=True)
            for received, msg in enumerate(stream):  # counted as they arrive (_update_chunk)
                faults.at(self.site, self.rank, round_, received, "pull")  # tests: mid-pull faults
                if full_state and shown is None:  # ops: a full state can be large
                    mine = -(-msg.total_chunks // max(parts, 1))
                    shown = Progress(f"state transfer of round {msg.next_round}", max(1, mine))
                if shown is not None:
                    shown.advance(note=f"{self.bytes_received:,} bytes received")
                if msg.header.fragment != fragment:
                    raise CodecError(
                        f"asked for fragment {fragment}, the stream carries {msg.header.fragment}"
                    )
                if last is not None and _facts(msg) != _facts(last):
                    raise CodecError("an update stream changed its codec, round or size midway")
                last = msg
                if msg.header.numel == 0:
                    continue  # no chunk for this puller: only the stream's facts
                payload = bytes(msg.payload) if self.keys is None else open_update(self.keys.down, msg)
                chunk = EncodedChunk(msg.header.start, msg.header.numel, payload)
                if on_chunk is not None:
                    facts = StreamFacts(
                        msg.kind == outer_sync_pb2.PullRequest.FULL_STATE,
                        msg.header.codec,
                        msg.header.round,
                        msg.state_hash,
                    )
                    on_chunk(msg.header.seq, chunk, facts)
                chunks[msg.header.seq] = chunk if keep_payloads else without_payload(chunk)
            if shown is not None:
                shown.close()
            if last is None:
                raise CodecError("the coordinator sent an empty update stream")
            self.assigned = ranges_from_proto(last.data)
            return PulledPart(
                is_full_state=last.kind == outer_sync_pb2.PullRequest.FULL_STATE,
                codec=last.header.codec,
                total_chunks=last.total_chunks,
                chunks=chunks,
                round=last.header.round,
                next_round=last.next_round,
                state_hash=last.state_hash,
                finished=last.finished,
                data=ranges_from_proto(last.data),
            )

        return self._with_backoff(f"pull of {_name(fragment, round_)}", attempt)

    def pull_tensor(
        self, round_: int, num_params: int, full_state: bool = False, timeout_s: float = 900.0
    ) -> PulledState:
        """Pull all of the update closing ``round_`` (or the full state) and decode it: for a
        single-process client (tools, tests); a site's ranks use :meth:`pull` with parts."""
        part = self.pull(round_, full_state=full_state, timeout_s=timeout_s)
        return PulledState(
            part.is_full_state,
            decode_whole(part, num_params),
            part.next_round,
            part.state_hash,
            part.finished,
            part.data,
        )


@dataclass(frozen=True, slots=True)
class PulledState:
    """A whole pulled update (add it) or full state (replace with it), decoded."""

    is_full_state: bool
    values: torch.Tensor
    next_round: int
    state_hash: str
    finished: bool
    data: list[DataRange]


def decode_whole(part: PulledPart, num_params: int) -> torch.Tensor:
    """Decode a pull that received every chunk (``parts`` = 1) into one canonical vector."""
    if len(part.chunks) != part.total_chunks:
        raise CodecError(f"have {len(part.chunks)} of the stream's {part.total_chunks} chunks")
    out = torch.empty(num_params, dtype=torch.float32)
    chunks = (part.chunks[s] for s in sorted(part.chunks))
    decode_chunks_into(parse_pipeline(part.codec), chunks, out, round_=part.round)
    return out


def _round_timeout(run_config_json: str) -> float:
    """The run's patience for a round (``round_timeout_s``), read from the config Join sent."""
    try:
        return float(json.loads(run_config_json).get("round_timeout_s", 0.0))
    except (ValueError, TypeError, AttributeError):  # the config is checked where it is used
        return 0.0


def _name(fragment: int, round_: int) -> str:
    return f"fragment {fragment} round {round_}" if fragment else f"round {round_}"


def _facts(msg: outer_sync_pb2.UpdateChunk) -> tuple[str, int, int, str, int]:
    return msg.header.codec, msg.header.round, msg.total_chunks, msg.state_hash, msg.kind


class Heartbeater:
    """Keeps the site's lease alive from a background thread while it trains or waits."""

    def __init__(self, client: OuterSyncClient, interval_s: float, world_size: int = 1) -> None:
        self.client = client
        self.interval_s = interval_s
        self.world_size = world_size
        self.round = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.client.heartbeat(self.round)
            except grpc.RpcError as exc:
                log.warning("heartbeat failed: %s", exc.code().name)
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and not self._stop.is_set():
                    self._rejoin()  # never after stop(): the site may have left on purpose

    def _rejoin(self) -> None:
        """The lease lapsed (a partition, a long stall): be counted as live again."""
        try:
            self.client.join(world_size=self.world_size)
            log.warning("lease had lapsed; rejoined the run")
        except grpc.RpcError as exc:
            log.warning("rejoin failed: %s", exc.code().name)
