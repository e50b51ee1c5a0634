"""A development PKI: one CA, and certificates for the coordinator, sites and admins.

Keys are ECDSA P-256 (accepted by gRPC's BoringSSL on both ends, small and fast to verify).
Every leaf carries its :class:`Identity` as a URI SAN; the coordinator's also carries its host
names and addresses, which clients check. Private keys are written with mode 0600 and never
overwritten. Users with their own PKI skip this module and point the flags at their files.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geodiloco.security.files import write_private
from geodiloco.security.identity import Identity

CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
CA_DAYS, LEAF_DAYS = 3650, 365


@dataclass(frozen=True, slots=True)
class IssuedFiles:
    """Where one identity's certificate and key were written."""

    cert: Path
    key: Path
    ca: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _validity(builder: x509.CertificateBuilder, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=days)
    )


def init_ca(directory: Path, name: str = "geodiloco dev CA") -> IssuedFiles:
    """Make a new CA in ``directory`` (refuses when one is already there)."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / CA_CERT).exists() or (directory / CA_KEY).exists():
        raise FileExistsError(f"{directory} already holds a CA ({CA_CERT}); use another directory")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    cert = _validity(builder, CA_DAYS).sign(key, hashes.SHA256())
    write_private(directory / CA_KEY, _key_pem(key))
    (directory / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return IssuedFiles(directory / CA_CERT, directory / CA_KEY, directory / CA_CERT)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
    key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / CA_KEY}: expected an EC private key")
    return cert, key


def _san_entries(identity: Identity, hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def issue(directory: Path, identity: Identity, hosts: list[str] | None = None) -> IssuedFiles:
    """Sign a certificate for ``identity`` with the CA in ``directory``.

    ``hosts`` (coordinator only) are the DNS names and IP addresses clients dial. Files are
    ``<role>-<name>.pem`` and ``<role>-<name>-key.pem``.
    """
    hosts = hosts or []
    if identity.role == "coordinator" and not hosts:
        raise ValueError("hosts: a coordinator certificate needs at least one host name or address")
    if identity.role != "coordinator" and hosts:
        raise ValueError("hosts: only coordinator certificates carry host names")
    ca_cert, ca_key = _load_ca(directory)
    stem = f"{identity.role}-{identity.name}"
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    if cert_path.exists() or key_path.exists():
        raise FileExistsError(f"{cert_path} already exists; remove it to reissue")
    key = ec.generate_private_key(ec.SECP256R1())
    usage = (
        ExtendedKeyUsageOID.SERVER_AUTH if identity.role == "coordinator" else ExtendedKeyUsageOID.CLIENT_AUTH
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_san_entries(identity, hosts)), critical=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    cert = _validity(builder, LEAF_DAYS).sign(ca_key, hashes.SHA256())
    write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return IssuedFiles(cert_path, key_path, directory / CA_CERT)
