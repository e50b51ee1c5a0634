"""The :class:`~geodiloco.site.link.Link` in one process: sites call the round controllers of a
:class:`LocalCoordinator` directly, no server, no wire.

The controllers run on an event loop in a thread of their own, as in the gRPC coordinator, and
the links call into it from the sites' threads; what crosses is what the wire would carry (the
encoded chunks, the committed updates, the facts of a pull), so the site's whole outer loop,
overlap and recovery included, runs in a unit test on plain tensors in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from geodiloco.compression import Place, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.coordinator.fragment_rounds import FragmentedController
from geodiloco.coordinator.intake import Pushes
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.refusals import (
    ContributionMissing,
    CoordinatorError,
    FailedPrecondition,
    LateContribution,
)
from geodiloco.coordinator.round_metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.site_calls import JoinCall, PullCall, ReportCall, SiteCalls
from geodiloco.exchange import (
    ChunkSink,
    JoinInfo,
    PulledPart,
    PullShare,
    PushPart,
    RoundReport,
    wire_chunk,
    without_payload,
)
from geodiloco.fragment_plan import FragmentPlan
from geodiloco.site.link import Joined, Late, LinkError, PushAgain, Resync
from geodiloco.workload.data import DataRange

T = TypeVar("T")
CALL_TIMEOUT_S = 600.0


def translate(exc: CoordinatorError) -> LinkError:
    """The domain error a refusal means to the site's loop (as the gRPC link maps its statuses)."""
    if isinstance(exc, ContributionMissing):
        return PushAgain(str(exc))
    if isinstance(exc, LateContribution):
        return Late(str(exc))
    if isinstance(exc, FailedPrecondition):
        return Resync(str(exc))
    return LinkError(f"{exc.status} {exc}")


class LocalCoordinator:
    """A run's fragment controllers on an event loop thread, ticking (leases, deadlines)."""

    def __init__(
        self,
        cfg: RunConfig,
        initial: torch.Tensor,
        shard_sizes: list[int],
        plan: FragmentPlan,
        tick_s: float = 0.02,
    ) -> None:
        self.cfg = cfg
        self.controller = FragmentedController.create(cfg, initial, shard_sizes, plan)
        journal = Journal(None)
        metrics = CoordinatorMetrics(self.controller.primary)
        self.calls = SiteCalls(
            self.controller, None, Pushes(self.controller, None, metrics, journal), journal
        )
        self.loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._tick_s = tick_s
        self._thread = threading.Thread(target=self._main, name="local-coordinator", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def run() -> None:
            while not self._stop.is_set():
                await self.controller.tick()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self._tick_s)

        self.loop.run_until_complete(run())

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = CALL_TIMEOUT_S) -> T:
        """Run ``coro`` on the coordinator's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def fragment(self, p: int) -> RoundController:
        return self.controller.fragments[p]

    def link(self, site: str) -> LocalLink:
        return LocalLink(self, site)

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def __enter__(self) -> LocalCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalLink:
    """One site's link to a :class:`LocalCoordinator`; counts the payload bytes it moves."""

    streams = 1  # in process: nothing to spread over connections

    def __init__(self, coordinator: LocalCoordinator, site: str) -> None:
        self.coordinator = coordinator
        self.c = coordinator.controller
        self.site = site
        self.run_id = ""
        self.bytes_sent = 0
        self.bytes_received = 0
        # parts of a push received so far, by (fragment, round): the staged vector and the parts
        self._staged: dict[tuple[int, int], tuple[torch.Tensor, set[int]]] = {}
        self._lock = threading.Lock()
        self._beat: threading.Thread | None = None
        self._closing = threading.Event()

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float = CALL_TIMEOUT_S) -> T:
        async def guarded() -> T:
            try:
                return await asyncio.wait_for(coro, timeout_s)
            except asyncio.TimeoutError:
                raise LinkError(f"DEADLINE_EXCEEDED no answer within {timeout_s:.0f}s") from None
            except CoordinatorError as exc:
                raise translate(exc) from exc

        return self.coordinator.call(guarded(), timeout_s + 5)

    def _fragment(self, index: int) -> RoundController:
        try:
            return self.c.fragment(index)
        except CoordinatorError as exc:
            raise translate(exc) from exc

    def join(self, world_size: int) -> Joined:
        async def join() -> JoinInfo:
            return await self.coordinator.calls.join(JoinCall(self.site, "", world_size))

        info = self._run(join())
        self.run_id = info.run_id
        with self._lock:
            self._staged.clear()  # a rejoined site pushes its rounds afresh
        return Joined(info, info.fragment_states)

    def adopt(self, run_id: str, key_id: int) -> None:
        self.run_id = run_id

    def keep_alive(self, interval_s: float, world_size: int) -> None:
        def beat() -> None:
            while not self._closing.wait(interval_s):
                try:
                    self._run(self._heartbeat())
                except Resync:
                    with contextlib.suppress(LinkError):  # tried again at the next beat
                        self.join(world_size)  # the lease lapsed: be counted as live again
                except LinkError:
                    pass

        self._beat = threading.Thread(target=beat, name=f"heartbeat-{self.site}", daemon=True)
        self._beat.start()

    async def _heartbeat(self) -> None:
        self.coordinator.calls.heartbeat(self.site, self.run_id)

    def push(self, part: PushPart, *, timeout_s: float) -> None:
        fragment, round_, chunks = part.fragment, part.round, part.chunks
        c = self._fragment(fragment)
        if self._run(self._check(c, round_), timeout_s):
            return  # an idempotent repeat of an accepted push
        pipeline = parse_pipeline(part.codec)
        key = (fragment, round_)
        with self._lock:
            staged, received = self._staged.setdefault(
                key, (torch.zeros(self.c.plan.numel(fragment), dtype=torch.float32), set())
            )
        for item in chunks:  # decoded on the pushing thread, as the gRPC intake does off its loop
            chunk = wire_chunk(item)
            segment = chunk.segment
            values = pipeline.decode(chunk.payload, segment.numel, Place(round_, segment))
            segment.view_of(staged).copy_(values.view(segment.rows, segment.row_len))
            self.bytes_sent += len(chunk.payload)
        with self._lock:
            received.add(part.part)
            if len(received) < part.parts:
                return
            del self._staged[key]
        self._run(self._contribute(c, round_, part.tokens, staged, part.data), timeout_s)

    async def _check(self, c: RoundController, round_: int) -> bool:
        """True for a duplicate; a late push is counted as the gRPC service counts it."""
        try:
            return c.check_push(self.site, self.run_id, round_)
        except LateContribution as exc:
            c.record_rejection(self.site, exc)
            raise

    async def _contribute(
        self,
        c: RoundController,
        round_: int,
        tokens: int,
        delta: torch.Tensor,
        data: list[DataRange] | None,
    ) -> None:
        try:
            await c.contribute(self.site, self.run_id, round_, tokens, delta, data)
        except LateContribution as exc:
            c.record_rejection(self.site, exc)
            raise

    def pull(
        self,
        share: PullShare,
        *,
        timeout_s: float,
        on_chunk: ChunkSink | None = None,
        keep_payloads: bool = True,
    ) -> PulledPart:
        """As over gRPC; ``on_chunk`` sees the chunks once the whole share is here (no wire).
        The payloads are the coordinator's own: ``keep_payloads=False`` drops them from the
        returned share only so that both links return the same."""
        if not keep_payloads and on_chunk is None:
            raise ValueError("keep_payloads=False needs an on_chunk sink: nothing would read the payloads")
        call = PullCall(self.site, self.run_id, share)

        async def pull() -> PulledPart:
            served = await self.coordinator.calls.pull(call)
            return PulledPart(
                is_full_state=served.full_state,
                codec=served.codec,
                total_chunks=served.total_chunks,
                chunks={seq: chunk for seq, chunk in served.mine if chunk.numel},
                round=served.round,
                next_round=served.next_round,
                state_hash=served.state_hash,
                finished=served.finished,
                data=served.data,
            )

        pulled = self._run(pull(), timeout_s)
        self.bytes_received += sum(len(ch.payload) for ch in pulled.chunks.values())
        if on_chunk is not None:
            for seq, chunk in pulled.chunks.items():
                on_chunk(seq, chunk, pulled.stream)
        if not keep_payloads:
            kept = {seq: without_payload(chunk) for seq, chunk in pulled.chunks.items()}
            pulled = dataclasses.replace(pulled, chunks=kept)
        return pulled

    def report(self, report: RoundReport) -> bool:
        ok, _ = self._run(self.coordinator.calls.report(ReportCall(self.site, self.run_id, report)))
        return ok

    def leave(self, reason: str) -> None:
        self._run(self.coordinator.calls.leave(self.site, self.run_id, reason))

    def close(self) -> None:
        self._closing.set()
        if self._beat is not None:
            self._beat.join(5)
