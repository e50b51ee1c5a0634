"""Shared pieces of the security suite: a real PKI, a real mTLS coordinator, sealed pushes.

Everything is real: certificates from :mod:`geodiloco.security.pki`, a grpc.aio coordinator
with ``require_client_auth`` on loopback, clients with their own certificates and secrets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from geodiloco.compression import encode_chunks, parse_pipeline
from geodiloco.params import state_hash
from geodiloco.security.chunks import seal_delta
from geodiloco.security.pki import PkiDir
from geodiloco.security.policy import ServerSecurity
from geodiloco.security.sealing import Keyring
from geodiloco.security.secrets import load_secret
from geodiloco.security.tls import TlsFiles
from geodiloco.site.edge.client import OuterSyncClient
from geodiloco.site.edge.client import delta_messages as push_stream
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import outer_sync_pb2_grpc

SITES = ["site-a", "site-b"]


@dataclass(frozen=True)
class Pki:
    dir: PkiDir
    coordinator: TlsFiles
    admin: TlsFiles
    sites: dict[str, tuple[TlsFiles, Path]]  # includes "site-x", which no run names

    def client(self, target: str, name: str, as_site: str | None = None) -> OuterSyncClient:
        """A client with ``name``'s certificate and secret, claiming to be ``as_site``."""
        files, secret = self.sites[name]
        return OuterSyncClient(target, as_site or name, tls=files, site_secret=load_secret(secret))


def make_pki(path: Path) -> Pki:
    pki = PkiDir(path)
    pki.init()
    return Pki(
        pki,
        pki.issue_coordinator(["127.0.0.1", "localhost"]),
        pki.issue_admin("ops"),
        {name: pki.issue_site(name) for name in [*SITES, "site-x"]},
    )


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Another CA issuing the same names: its certificates must be worthless here."""
    return make_pki(tmp_path_factory.mktemp("other-pki"))


def hostile_config(**overrides: Any) -> Any:
    """Small limits so every guard can be hit quickly; fp32 uplink so NaN reaches the value checks."""
    limits = {
        "max_message_bytes": 65536,
        "chunk_timeout_s": 1.0,
        "joins_per_minute": 5,
        "max_delta_norm_ratio": 1.0,
    }
    settings: dict[str, Any] = {
        "sites": SITES,
        "rounds": 3,
        "compression__uplink": "fp32",
        "compression__chunk_elements": 4096,
        **{f"limits__{k}": v for k, v in limits.items()},
    }
    return tiny_config(**{**settings, **overrides})


def secure_coordinator(pki: Pki, cfg: Any) -> CoordinatorThread:
    keyring = Keyring(load_secret(pki.dir.run_secret), cfg.run_id)
    return CoordinatorThread(cfg, security=ServerSecurity(tls=pki.coordinator, keyring=keyring))


@pytest.fixture
def coordinator(pki: Pki) -> Iterator[CoordinatorThread]:
    with secure_coordinator(pki, hostile_config()) as c:
        yield c


def delta_messages(
    client: OuterSyncClient,
    round_: int,
    delta: torch.Tensor,
    *,
    codec: str = "fp32",
    tokens: int = 100,
    chunk_elements: int = 4096,
    seal: bool = True,
) -> list[Any]:
    """The messages a site's push would send, sealed with its keys, for tampering with."""
    chunks, _ = encode_chunks(parse_pipeline(codec), delta, chunk_elements, round_=round_)
    messages = []
    for msg in push_stream(client.run_id, client.site, round_, codec, chunks, tokens, client.assigned):
        if seal:
            assert client.keys is not None
            seal_delta(client.keys.up, msg)
        messages.append(msg)
    return messages


def push_raw(client: OuterSyncClient, messages: list[Any], timeout: float = 10) -> Any:
    return outer_sync_pb2_grpc.OuterSyncStub(client.channel).PushDelta(iter(messages), timeout=timeout)


def refused(call: Any) -> grpc.RpcError:
    """Run ``call``; it must fail with an RpcError, which is returned."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def small_delta(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3


def assert_unchanged(c: CoordinatorThread, round_: int = 0) -> None:
    """The committed state is what it was: same round, no contribution, θ as committed."""
    ctl = c.controller
    assert ctl.round == round_
    assert not ctl.mean.contributors
    assert state_hash(ctl.theta) == ctl.hashes[round_]


def assert_run_continues(c: CoordinatorThread, clients: list[OuterSyncClient], round_: int = 0) -> None:
    """Honest sites still complete the round: both push, the round commits, both pull it."""
    n = c.controller.num_params
    for i, client in enumerate(clients):
        ack = push_raw(client, delta_messages(client, round_, small_delta(n, seed=i)))
        assert not ack.duplicate
    for client in clients:
        pulled = client.pull(round_, n)
        assert pulled.next_round == round_ + 1
        assert pulled.state_hash == c.controller.hashes[round_ + 1]
    assert c.controller.history[round_].contributors == sorted(x.site for x in clients)
