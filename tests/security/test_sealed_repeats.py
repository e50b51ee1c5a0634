"""Repeats of a sealed push: a retry is sealed afresh (new nonces), so the coordinator must
compare pushes as opened, not as sent (mTLS, sealing, real gRPC on loopback)."""

from __future__ import annotations

import grpc
import pytest

from geodiloco.testing.servers import CoordinatorThread

from .conftest import Pki, delta_messages, push_raw, refused, small_delta

pytestmark = pytest.mark.integration


def test_a_resealed_retry_is_a_duplicate_and_a_different_push_is_refused(
    coordinator: CoordinatorThread, pki: Pki
) -> None:
    a, b = pki.client(coordinator.target, "site-a"), pki.client(coordinator.target, "site-b")
    a.join(), b.join()  # site-b live: round 0 stays open
    n = coordinator.controller.num_params
    first = delta_messages(a, 0, small_delta(n, seed=7))
    assert len(first) > 1
    assert not push_raw(a, first).duplicate
    retry = delta_messages(a, 0, small_delta(n, seed=7))
    assert all(x.header.nonce != y.header.nonce for x, y in zip(first, retry, strict=True))
    assert push_raw(a, retry).duplicate
    err = refused(lambda: push_raw(a, delta_messages(a, 0, small_delta(n, seed=8))))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "a different push for round 0" in err.details()
    unsealed = delta_messages(a, 0, small_delta(n, seed=7), seal=False)
    err = refused(lambda: push_raw(a, unsealed))  # not even opened: the sealing mismatch is named
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not sealed" in err.details()
    c = coordinator.controller
    assert c.round == 0 and c.mean.contributors == ["site-a"] and c.sites["site-a"].accepted == 1
    assert not push_raw(b, delta_messages(b, 0, small_delta(n, seed=9))).duplicate
    assert c.round == 1 and c.history[0].contributors == ["site-a", "site-b"]
