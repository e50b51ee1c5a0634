"""The development PKI and the `geodiloco certs` commands."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from geodiloco.app.cli import main
from geodiloco.security.identity import Identity
from geodiloco.security.secrets import load_secret, site_secret


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_certs_commands_make_a_working_pki(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "pki"
    assert main(["certs", "init", str(d)]) == 0
    assert main(["certs", "issue", "--dir", str(d), "--site", "dc-west"]) == 0
    assert main(["certs", "issue", "--dir", str(d), "--coordinator", "coord.example,10.0.0.5"]) == 0
    assert main(["certs", "issue", "--dir", str(d), "--admin", "alice"]) == 0
    for key in (
        "ca-key.pem",
        "site-dc-west-key.pem",
        "coordinator-coord.example-key.pem",
        "admin-alice-key.pem",
    ):
        assert mode(d / key) == 0o600, key
    assert mode(d / "run.secret") == mode(d / "site-dc-west.secret") == 0o600
    assert load_secret(d / "site-dc-west.secret") == site_secret(load_secret(d / "run.secret"), "dc-west")

    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    site = x509.load_pem_x509_certificate((d / "site-dc-west.pem").read_bytes())
    coord = x509.load_pem_x509_certificate((d / "coordinator-coord.example.pem").read_bytes())
    assert isinstance(site.public_key(), ec.EllipticCurvePublicKey)
    assert site.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    site.verify_directly_issued_by(ca)
    san = site.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [Identity("site", "dc-west").uri]
    coord_san = coord.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert coord_san.get_values_for_type(x509.DNSName) == ["coord.example"]
    assert [str(ip) for ip in coord_san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert "spiffe://geodiloco/coordinator/coord.example" in coord_san.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    secret_text = load_secret(d / "run.secret").hex()
    assert secret_text not in capsys.readouterr().out


def test_certs_refuse_to_overwrite_and_rotation_rederives_site_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "pki"
    assert main(["certs", "init", str(d)]) == 0
    assert main(["certs", "issue", "--dir", str(d), "--site", "a"]) == 0
    assert main(["certs", "init", str(d)]) == 2
    assert main(["certs", "issue", "--dir", str(d), "--site", "a"]) == 2
    assert "already" in capsys.readouterr().err
    old = load_secret(d / "run.secret")
    assert main(["certs", "secret", "--dir", str(d), "--rotate"]) == 0
    new = load_secret(d / "run.secret")
    assert new != old and mode(d / "run.secret") == 0o600
    assert load_secret(d / "site-a.secret") == site_secret(new, "a")


def test_identity_uris_round_trip_and_reject_other_shapes() -> None:
    ident = Identity("site", "dc-west")
    assert Identity.from_uri(ident.uri) == ident
    for uri in (
        "spiffe://other/site/dc-west",
        "spiffe://geodiloco/root/dc-west",
        "spiffe://geodiloco/site/a/b",
        "spiffe://geodiloco/site/",
    ):
        assert Identity.from_uri(uri) is None, uri
    with pytest.raises(ValueError, match="role"):
        Identity("superuser", "x")


def test_insecure_is_refused_off_loopback_and_secure_needs_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["coordinator", "serve", "--insecure", "--host", "0.0.0.0"]) == 2
    assert "only loopback" in capsys.readouterr().err
    assert main(["coordinator", "serve"]) == 2
    assert "--tls-cert, --tls-key and --tls-ca are required" in capsys.readouterr().err
    assert main(["site", "run", "--name", "a", "--coordinator", "10.1.2.3:50051", "--insecure"]) == 2
    assert "only loopback" in capsys.readouterr().err
    missing = ["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", "k", "--tls-ca", "c"]
    assert main(["status", *missing]) == 2
    assert "tls.cert: no such file" in capsys.readouterr().err
