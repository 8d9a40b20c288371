"""HTTPS on the gateway that `strata up` starts (``--tls-cert`` / ``--tls-key``): the pair is
checked before any process starts, and the launcher's own probes of the gateway on this machine
trust exactly the certificate it serves (self-signed or issued by a CA the system does not know).
"""

from __future__ import annotations

import ssl


def check_pair(cert: str, key: str) -> None:
    """One-line RuntimeError unless ``cert`` and ``key`` are both given, readable PEM, and match."""
    if bool(cert) != bool(key):
        raise RuntimeError("--tls-cert and --tls-key go together (the gateway's HTTPS pair)")
    if not cert:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RuntimeError(
            f"gateway TLS: cannot use --tls-cert {cert} / --tls-key {key}: {why}"
        ) from None


def local_context(cert: str) -> ssl.SSLContext:
    """Client context that trusts ``cert`` itself (partial chain), for probing our own gateway;
    the host name is not checked (the gateway may listen on 0.0.0.0)."""
    ctx = ssl.create_default_context(cafile=cert)
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.check_hostname = False
    return ctx
