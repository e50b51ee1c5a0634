"""Certificate problems named on the client side, before and while dialling.

A failed TLS handshake reaches a gRPC client only as UNAVAILABLE ("Deadline Exceeded" once its
retries run out), so an expired certificate or one from another CA looked like a coordinator that
is down. Here the client's own certificate is checked locally (validity dates, issuer and
signature against the CA it was given, the identity it will claim), and one TLS handshake with
the coordinator, made with the same files, turns a refusal on either side into a message that
names the certificate and the TLS error.
"""

from __future__ import annotations

import datetime
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.padding import PKCS1v15

from geodiloco.security.identity import Identity
from geodiloco.security.tls import TlsFiles

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS


class CertificateProblem(ValueError):
    """A certificate that cannot work, in one line naming it."""


def _load(path: Path, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CertificateProblem(f"{what} {path}: not a PEM certificate ({exc})") from None


def describe(cert: x509.Certificate) -> str:
    """Subject, issuer and validity of a certificate, for messages."""
    return (
        f"subject {cert.subject.rfc4514_string()!r}, issuer {cert.issuer.rfc4514_string()!r}, "
        f"valid {cert.not_valid_before_utc:%Y-%m-%d %H:%M} to {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    )


def identity_of(cert: x509.Certificate) -> Identity | None:
    """The geodiloco identity in a certificate's URI SAN, if any."""
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in uris.get_values_for_type(x509.UniformResourceIdentifier):
        identity = Identity.from_uri(uri)
        if identity is not None:
            return identity
    return None


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    key = ca.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            assert cert.signature_hash_algorithm is not None
            key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
        elif isinstance(key, rsa.RSAPublicKey):
            assert cert.signature_hash_algorithm is not None
            key.verify(cert.signature, cert.tbs_certificate_bytes, PKCS1v15(), cert.signature_hash_algorithm)
        else:
            return cert.issuer == ca.subject
    except InvalidSignature:
        return False
    return cert.issuer == ca.subject


def _check_dates(cert: x509.Certificate, what: str, now: datetime.datetime) -> None:
    if now < cert.not_valid_before_utc:
        raise CertificateProblem(f"{what} is not valid yet (check the clock): {describe(cert)}")
    if now > cert.not_valid_after_utc:
        raise CertificateProblem(f"{what} has expired: {describe(cert)}")


def check_local(
    tls: TlsFiles, role: str | None = None, name: str | None = None, now: datetime.datetime | None = None
) -> x509.Certificate:
    """The client's certificate, after checking its dates, its CA and (if given) the identity
    it must carry; a CertificateProblem otherwise."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cert, ca = _load(tls.cert, "--tls-cert"), _load(tls.ca, "--tls-ca")
    _check_dates(ca, f"the CA {tls.ca}", now)
    _check_dates(cert, f"the certificate {tls.cert}", now)
    if not _signed_by(cert, ca):
        raise CertificateProblem(
            f"the certificate {tls.cert} was not issued by the CA {tls.ca} "
            f"(CA subject {ca.subject.rfc4514_string()!r}): {describe(cert)}"
        )
    identity = identity_of(cert)
    if role is not None and (identity is None or identity.role != role or (name and identity.name != name)):
        wanted = Identity(role, name).uri if name else f"a {role} identity"
        raise CertificateProblem(
            f"the certificate {tls.cert} identifies {identity or 'no geodiloco identity'}, "
            f"not {wanted}: {describe(cert)}"
        )
    return cert


def probe_handshake(target: str, tls: TlsFiles, timeout_s: float = 5.0) -> None:
    """One TLS handshake with the coordinator using ``tls``; a refusal by either side is a
    CertificateProblem naming the TLS error. An unreachable coordinator is not a certificate
    problem: the caller waits for it as usual."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]") or "localhost"
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    context.set_alpn_protocols(["h2"])
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return
    try:
        with context.wrap_socket(raw, server_hostname=host) as conn:
            # TLS 1.3 servers refuse a client certificate after the handshake: read their answer
            conn.sendall(HTTP2_PREFACE)
            answer = conn.recv(1)
    except ssl.SSLCertVerificationError as exc:
        raise CertificateProblem(
            f"TLS handshake with {target} failed: the coordinator's certificate does not verify "
            f"against --tls-ca {tls.ca}: {exc.verify_message}"
        ) from None
    except ssl.SSLError as exc:
        raise CertificateProblem(
            f"TLS handshake with {target} failed: the coordinator refused this certificate "
            f"({exc.reason or exc}); it accepts only certificates of the run's CA"
        ) from None
    except OSError:
        return  # a reset or timeout after the handshake: not a certificate verdict
    finally:
        raw.close()
    if not answer:  # gRPC servers close without an alert when they refuse a client certificate
        raise CertificateProblem(
            f"TLS handshake with {target} failed: the coordinator refused this certificate "
            f"(closed the connection after the handshake); it accepts only certificates of the run's CA"
        )
