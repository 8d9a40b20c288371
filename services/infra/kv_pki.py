"""The KV plane's own small CA: one certificate per service, for mTLS on every gRPC channel.

`strata up` calls `ensure_pki` before it starts the services: it creates ``<data dir>/pki``
(mode 0700) with ``ca.pem`` / ``ca.key`` and one ``<name>.pem`` / ``<name>.key`` per process
(keys 0600), reuses them on the next start while they are valid for more than
`RENEW_BEFORE_DAYS`, and issues new leaf certificates when asked (``--rotate-certs``) or when one
is about to expire. Deleting ``pki/`` (or ``--rotate-ca``) makes a new CA: every leaf is
re-issued under it, so processes of one cluster always share one CA.

Keys are ECDSA P-256, made with the maintained ``cryptography`` package (no external ``openssl``
binary, the same code in the image and on the host). Leaf certificates carry the addresses the
services dial (the cluster's bind host, ``127.0.0.1``, ``localhost``) as subjectAltNames and are
valid for both server and client authentication: every model process serves and dials.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.infra.procs import write_file

CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE_DAYS = 30
_CA_NAME = "Strata KV plane CA"


@dataclass(frozen=True)
class ServiceCert:
    """Paths of one process's certificate and key, and of the CA every peer trusts."""

    cert: str
    key: str
    ca: str

    def env(self) -> dict[str, str]:
        """The ``STRATA_GRPC_TLS_*`` settings that make a process serve and dial mutual TLS."""
        return {
            "STRATA_GRPC_TLS_CERT": self.cert,
            "STRATA_GRPC_TLS_KEY": self.key,
            "STRATA_GRPC_TLS_CA": self.ca,
            "STRATA_GRPC_TLS_VERIFY_CLIENTS": "true",
        }


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load(cert_path: str, key_path: str):
    try:
        with open(cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        with open(key_path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), password=None)
    except (OSError, ValueError):
        return None
    return cert, key


def _fresh(cert: x509.Certificate) -> bool:
    return cert.not_valid_after_utc - _now() > dt.timedelta(days=RENEW_BEFORE_DAYS)


def _sans(hosts: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    seen: set[str] = set()
    for h in [*hosts, "127.0.0.1", "localhost"]:
        if not h or h in seen or h in ("0.0.0.0", "::"):
            continue
        seen.add(h)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def issue(
    name: str,
    hosts: list[str],
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    not_before: dt.datetime | None = None,
    days: int = LEAF_DAYS,
) -> tuple[bytes, bytes]:
    """A leaf certificate for process ``name`` signed by the CA: (cert PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(_sans(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_ca(common_name: str = _CA_NAME) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start = _now() - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def ensure_pki(
    directory: str,
    names: list[str],
    hosts: list[str],
    *,
    rotate: bool = False,
    rotate_ca: bool = False,
) -> dict[str, ServiceCert]:
    """The CA and one certificate per name under ``directory``, made or reused (see module)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_pem, ca_key_path = os.path.join(directory, "ca.pem"), os.path.join(directory, "ca.key")
    loaded = None if rotate_ca else _load(ca_pem, ca_key_path)
    new_ca = loaded is None or not _fresh(loaded[0])
    if new_ca:
        ca_cert, ca_key = make_ca()
        write_file(ca_key_path, _key_pem(ca_key), 0o600)
        write_file(ca_pem, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    else:
        ca_cert, ca_key = loaded
    want = set(_sans(hosts))
    out: dict[str, ServiceCert] = {}
    for name in names:
        cert_path = os.path.join(directory, f"{name}.pem")
        key_path = os.path.join(directory, f"{name}.key")
        have = None if (rotate or new_ca) else _load(cert_path, key_path)
        if have is not None:
            cert = have[0]
            try:
                sans = set(
                    cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                )
            except x509.ExtensionNotFound:
                sans = set()
            if not (_fresh(cert) and cert.issuer == ca_cert.subject and want <= sans):
                have = None
        if have is None:
            cert_bytes, key_bytes = issue(name, hosts, ca_cert, ca_key)
            write_file(key_path, key_bytes, 0o600)
            write_file(cert_path, cert_bytes, 0o644)
        out[name] = ServiceCert(cert_path, key_path, ca_pem)
    return out
