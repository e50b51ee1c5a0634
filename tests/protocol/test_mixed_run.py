"""A mixed run over mTLS with sealed payloads: the TypeScript site (clients/typescript, written
from docs/protocol.md) next to a Python site, against the real coordinator; 3 rounds, every
site's parameter hash agrees with the coordinator's every round."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from geodiloco.security.pki import PkiDir
from geodiloco.security.policy import ServerSecurity
from geodiloco.security.sealing import Keyring
from geodiloco.security.secrets import load_secret
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree, spawn_geodiloco
from geodiloco.testing.servers import CoordinatorThread

pytestmark = pytest.mark.integration

TS_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "typescript"


def ts_site(target: str, name: str, pki: PkiDir, log: Path) -> subprocess.Popen[bytes]:
    """`tsx src/site.ts` with the site's certificate and secret (needs `npm ci` in clients/typescript)."""
    tsx = TS_CLIENT / "node_modules" / ".bin" / "tsx"
    assert tsx.exists(), "run `npm ci` in clients/typescript (make setup does)"
    files, secret = pki.issue_site(name)
    args = ["--coordinator", target, "--name", name, "--secret", str(secret)]
    args += ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]
    with open(log, "ab") as out:
        command = [str(tsx), "src/site.ts", *args]
        return subprocess.Popen(command, cwd=TS_CLIENT, stdout=out, stderr=subprocess.STDOUT)


def test_typescript_and_python_sites_agree_every_round(tmp_path: Path) -> None:
    cfg = tiny_config(sites=["site-py", "site-ts"], min_sites=2, rounds=3, compression__chunk_elements=4096)
    pki = PkiDir(tmp_path / "pki")
    pki.init()
    security = ServerSecurity(
        tls=pki.issue_coordinator(["127.0.0.1", "localhost"]),
        keyring=Keyring(load_secret(pki.run_secret), cfg.run_id),
    )
    py_files, py_secret = pki.issue_site("site-py")
    with CoordinatorThread(cfg, security=security) as coordinator:
        ts = ts_site(coordinator.target, "site-ts", pki, tmp_path / "site-ts.log")
        py_args = ["site", "run", "--name", "site-py", "--coordinator", coordinator.target, "--nproc", "1"]
        py_args += ["--tls-cert", str(py_files.cert), "--tls-key", str(py_files.key)]
        py_args += ["--tls-ca", str(py_files.ca), "--secret", str(py_secret)]
        py = spawn_geodiloco(py_args, tmp_path / "site-py.log")
        try:
            assert ts.wait(timeout=240) == 0, (tmp_path / "site-ts.log").read_text()[-3000:]
            assert py.wait(timeout=240) == 0, (tmp_path / "site-py.log").read_text()[-3000:]
        finally:
            for proc in (ts, py):
                if proc.poll() is None:
                    kill_tree(proc)
        history = coordinator.controller.history
        sites = coordinator.controller.sites
    assert [h.round for h in history] == [0, 1, 2]
    for record in history:
        assert record.contributors == ["site-py", "site-ts"]
        assert sorted(record.hash_reports) == ["site-py", "site-ts"] and record.hashes_agree
    assert all(s.state == "left" and s.accepted == 3 and s.rejected == 0 for s in sites.values())
    lines = [json.loads(x) for x in (tmp_path / "site-ts.log").read_text().splitlines() if x.startswith("{")]
    rounds = [x for x in lines if x["event"] == "round"]
    assert [(x["round"], x["hash"], x["hash_ok"]) for x in rounds] == [
        (h.round, h.state_hash, True) for h in history
    ]
    assert all(x["kind"] == "UPDATE" for x in rounds)


def test_a_site_without_the_runs_codec_leaves_saying_which(tmp_path: Path) -> None:
    """Codec negotiation (docs/protocol.md §9): the run config names the codecs; a site that lacks
    one leaves with the reason instead of pushing chunks that would be refused."""
    cfg = tiny_config(sites=["site-ts"], rounds=2, compression__uplink="fp16")
    tsx = TS_CLIENT / "node_modules" / ".bin" / "tsx"
    with CoordinatorThread(cfg) as coordinator:
        command = [str(tsx), "src/site.ts", "--coordinator", coordinator.target, "--name", "site-ts"]
        result = subprocess.run(
            [*command, "--insecure"], cwd=TS_CLIENT, capture_output=True, text=True, timeout=60
        )
        state = coordinator.controller.sites["site-ts"].state
    assert result.returncode == 2, result.stderr
    assert "unsupported codec" in result.stderr and '"fp16"' in result.stderr
    assert state == "left"


def test_the_typescript_site_alone_on_a_plaintext_run(tmp_path: Path) -> None:
    """Unsealed payloads (key id 0, loopback only), a q4 uplink and an fp32|zstd downlink."""
    cfg = tiny_config(
        sites=["site-ts"], rounds=2, compression__uplink="q4", compression__downlink="fp32|zstd:1"
    )
    tsx = TS_CLIENT / "node_modules" / ".bin" / "tsx"
    with CoordinatorThread(cfg) as coordinator:
        command = [str(tsx), "src/site.ts", "--coordinator", coordinator.target, "--name", "site-ts"]
        result = subprocess.run(
            [*command, "--insecure"], cwd=TS_CLIENT, capture_output=True, text=True, timeout=120
        )
        history = coordinator.controller.history
    assert result.returncode == 0, result.stderr
    rounds = [json.loads(x) for x in result.stdout.splitlines() if '"event":"round"' in x]
    assert [(x["round"], x["hash"], x["hash_ok"]) for x in rounds] == [
        (h.round, h.state_hash, True) for h in history
    ]
    assert len(history) == 2 and all(h.contributors == ["site-ts"] for h in history)
