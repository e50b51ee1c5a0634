"""Certificate problems are named by the client, before and while dialling (issue 17), instead of
surfacing as UNAVAILABLE / Deadline Exceeded after minutes of retries."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from geodiloco.security.certcheck import CertificateProblem, check_local, probe_handshake
from geodiloco.security.tls import TlsFiles

from .conftest import Pki, secure_coordinator

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


def resigned(
    pki: Pki, files: TlsFiles, out: Path, start: datetime.datetime, end: datetime.datetime
) -> TlsFiles:
    """A copy of ``files`` whose certificate the same CA signed for [start, end]."""
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca_key = serialization.load_pem_private_key((pki.dir.path / "ca-key.pem").read_bytes(), None)
    builder = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(cert.issuer)
        .public_key(cert.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
    )
    for ext in cert.extensions:
        builder = builder.add_extension(ext.value, ext.critical)
    out.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return TlsFiles(out, files.key, files.ca)


def test_an_expired_certificate_is_named_with_its_subject_and_dates(pki: Pki, tmp_path: Path) -> None:
    files = resigned(pki, pki.sites["site-a"][0], tmp_path / "old.pem", NOW - 30 * DAY, NOW - DAY)
    with pytest.raises(CertificateProblem, match=r"has expired: subject 'CN=site-a'.*valid \d{4}-"):
        check_local(files, "site", "site-a")


def test_a_certificate_not_yet_valid_is_named(pki: Pki, tmp_path: Path) -> None:
    files = resigned(pki, pki.sites["site-a"][0], tmp_path / "future.pem", NOW + DAY, NOW + 30 * DAY)
    with pytest.raises(CertificateProblem, match="is not valid yet"):
        check_local(files, "site", "site-a")


def test_a_certificate_of_another_ca_is_named(pki: Pki, other_pki: Pki) -> None:
    theirs = other_pki.sites["site-a"][0]
    with pytest.raises(CertificateProblem, match="was not issued by the CA"):
        check_local(TlsFiles(theirs.cert, theirs.key, pki.sites["site-a"][0].ca), "site", "site-a")


def test_a_certificate_of_another_site_is_named(pki: Pki) -> None:
    with pytest.raises(
        CertificateProblem, match="identifies site site-b, not spiffe://geodiloco/site/site-a"
    ):
        check_local(pki.sites["site-b"][0], "site", "site-a")
    assert check_local(pki.sites["site-a"][0], "site", "site-a").subject.rfc4514_string() == "CN=site-a"


@pytest.mark.integration
def test_the_handshake_names_a_coordinator_of_another_ca(pki: Pki, other_pki: Pki) -> None:
    """The site's own files are consistent (another CA's site certificate and CA), so only the
    handshake can tell: the coordinator's certificate does not verify."""
    from geodiloco.testing.configs import tiny_config

    with secure_coordinator(pki, tiny_config(sites=["site-a", "site-b"])) as c:
        probe_handshake(c.target, pki.sites["site-a"][0])  # the right files: no complaint
        with pytest.raises(CertificateProblem, match="coordinator's certificate does not verify"):
            probe_handshake(c.target, other_pki.sites["site-a"][0])
        theirs = other_pki.sites["site-a"][0]  # our CA, their certificate: the server refuses it
        with pytest.raises(CertificateProblem, match="the coordinator refused this certificate"):
            probe_handshake(c.target, TlsFiles(theirs.cert, theirs.key, pki.sites["site-a"][0].ca))
    probe_handshake("127.0.0.1:1", pki.sites["site-a"][0])  # nothing listening: not a certificate verdict


def test_site_run_with_an_expired_certificate_fails_in_one_line(pki: Pki, tmp_path: Path) -> None:
    files = resigned(pki, pki.sites["site-a"][0], tmp_path / "old.pem", NOW - 30 * DAY, NOW - DAY)
    started = time.monotonic()
    command = [sys.executable, "-m", "geodiloco", "site", "run", "--name", "site-a", "--nproc", "1"]
    command += ["--coordinator", "127.0.0.1:1", "--secret", str(pki.sites["site-a"][1])]
    command += ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert time.monotonic() - started < 30
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "has expired" in lines[0] and "CN=site-a" in lines[0]
