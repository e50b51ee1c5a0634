"""mTLS and authorisation against a real coordinator: who may connect, as whom, to call what."""

from __future__ import annotations

import grpc
import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.security.secrets import load_secret
from geodiloco.site.edge.client import OuterSyncClient
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import admin_pb2, admin_pb2_grpc, outer_sync_pb2, outer_sync_pb2_grpc

from .conftest import (
    Pki,
    assert_run_continues,
    assert_unchanged,
    delta_messages,
    push_raw,
    refused,
    small_delta,
)

pytestmark = pytest.mark.integration


def join_request(site: str) -> outer_sync_pb2.JoinRequest:
    return outer_sync_pb2.JoinRequest(site=site)


def test_client_without_certificate_is_refused_at_the_handshake(
    coordinator: CoordinatorThread, pki: Pki
) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki.coordinator.ca.read_bytes())
    with grpc.secure_channel(coordinator.target, creds) as channel:
        err = refused(
            lambda: outer_sync_pb2_grpc.OuterSyncStub(channel).Join(join_request("site-a"), timeout=5)
        )
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(coordinator.target) as channel:  # plaintext to a TLS port
        err = refused(
            lambda: outer_sync_pb2_grpc.OuterSyncStub(channel).Join(join_request("site-a"), timeout=5)
        )
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert coordinator.controller.live_sites() == set()


def test_certificate_from_another_ca_is_refused(
    coordinator: CoordinatorThread, pki: Pki, other_pki: Pki
) -> None:
    stranger = other_pki.client(coordinator.target, "site-a")  # right name, wrong CA
    err = refused(lambda: stranger.stub.Join(join_request("site-a"), timeout=5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert coordinator.controller.live_sites() == set()
    assert_unchanged(coordinator)


def test_valid_certificate_for_a_site_not_in_the_run_is_refused(
    coordinator: CoordinatorThread, pki: Pki
) -> None:
    outsider = pki.client(coordinator.target, "site-x")
    err = refused(outsider.join)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not part of run" in err.details()
    assert set(coordinator.controller.sites) == {"site-a", "site-b"}
    a, b = pki.client(coordinator.target, "site-a"), pki.client(coordinator.target, "site-b")
    a.join(), b.join()
    assert_run_continues(coordinator, [a, b])


def test_a_site_cannot_act_as_another_site(coordinator: CoordinatorThread, pki: Pki) -> None:
    a, b = pki.client(coordinator.target, "site-a"), pki.client(coordinator.target, "site-b")
    a.join(), b.join()
    n = coordinator.controller.num_params
    impostor = pki.client(coordinator.target, "site-a", as_site="site-b")  # site-a's cert, claims b
    impostor.run_id, impostor.keys = a.run_id, b.keys  # even holding b's keys does not help
    calls = {
        "Join": lambda: impostor.join(),
        "Heartbeat": lambda: impostor.heartbeat(0),
        "Report": lambda: impostor.report(0, "x", 0.0, 0, 0.0, 1, 0.0),
        "PushDelta": lambda: push_raw(impostor, delta_messages(impostor, 0, small_delta(n))),
        "PullUpdate": lambda: impostor.pull_tensor(0, n, full_state=True),
        "Leave": lambda: impostor.leave("hijack"),
    }
    for rpc, call in calls.items():
        err = refused(call)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, rpc
        assert "identifies site 'site-a'" in err.details(), rpc
    assert coordinator.controller.sites["site-b"].state == "joined"
    assert_unchanged(coordinator)
    assert_run_continues(coordinator, [a, b])


def test_admin_rpcs_need_an_admin_certificate(coordinator: CoordinatorThread, pki: Pki) -> None:
    a = pki.client(coordinator.target, "site-a")
    a.join()
    admin_stub = admin_pb2_grpc.AdminStub(a.channel)
    err = refused(lambda: admin_stub.Shutdown(admin_pb2.ShutdownRequest(grace_s=0), timeout=5))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not coordinator.running.stop.is_set()  # type: ignore[union-attr]
    public = admin_stub.GetStatus(admin_pb2.StatusRequest(), timeout=5)
    assert public.run_id == "test-run" and public.rounds_total == 3
    assert not public.sites and not public.history  # per-site details are for admins
    full = fetch_status(coordinator.target, pki.admin)
    assert [s.site for s in full.sites] == ["site-a", "site-b"]
    # an admin certificate is no site certificate
    admin_as_site = OuterSyncClient(coordinator.target, "site-a", tls=pki.admin)
    assert refused(admin_as_site.join).code() == grpc.StatusCode.PERMISSION_DENIED
    request_shutdown(coordinator.target, pki.admin, grace_s=0.1)
    assert coordinator.running.stop.is_set()  # type: ignore[union-attr]


def test_site_with_the_wrong_secret_is_refused_at_join_and_never_a_member(
    coordinator: CoordinatorThread, pki: Pki, other_pki: Pki
) -> None:
    """The key proof in Join (issue 16 item 5): refused before membership, so nothing waits for it."""
    files, _ = pki.sites["site-a"]
    wrong = OuterSyncClient(
        coordinator.target, "site-a", tls=files, site_secret=load_secret(other_pki.sites["site-a"][1])
    )
    err = refused(wrong.join)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "does not hold its secret" in (err.details() or "")
    no_secret = OuterSyncClient(coordinator.target, "site-a", tls=files)
    err = refused(no_secret.join)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "must prove its secret" in (err.details() or "")
    # another site's secret (same run secret) proves nothing for site-a either
    _, secret_b = pki.sites["site-b"]
    other_site = OuterSyncClient(coordinator.target, "site-a", tls=files, site_secret=load_secret(secret_b))
    assert refused(other_site.join).code() == grpc.StatusCode.UNAUTHENTICATED
    assert coordinator.controller.sites["site-a"].state == "absent"
    assert "site-a" not in coordinator.controller.live_sites()
    assert coordinator.controller.ledger.reservation("site-a") is None
    assert_unchanged(coordinator)
    pki.client(coordinator.target, "site-a").join()  # the right secret is admitted
    assert coordinator.controller.sites["site-a"].state == "joined"


def test_a_site_with_a_secret_is_refused_by_a_run_that_does_not_seal(pki: Pki) -> None:
    with CoordinatorThread(tiny_config()) as plain:
        _, secret = pki.sites["site-a"]
        client = OuterSyncClient(plain.target, "site-a", site_secret=load_secret(secret))
        err = refused(client.join)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "does not seal" in (err.details() or "")
        assert plain.controller.sites["site-a"].state == "absent"


def test_a_full_run_over_mtls_with_sealed_payloads(coordinator: CoordinatorThread, pki: Pki) -> None:
    a, b = pki.client(coordinator.target, "site-a"), pki.client(coordinator.target, "site-b")
    a.join(), b.join()
    for round_ in range(3):
        assert_run_continues(coordinator, [a, b], round_)
    full = a.pull_tensor(2, coordinator.controller.num_params, full_state=True)
    assert full.is_full_state and full.state_hash == coordinator.controller.hashes[3]
    assert coordinator.controller.finished
