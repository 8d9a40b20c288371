"""TLS for the KVTransfer gRPC traffic (KV pushes and pulls, pool reads, image embeddings).

Off by default (plaintext, as on a trusted network or one host). With ``STRATA_GRPC_TLS_CERT`` /
``STRATA_GRPC_TLS_KEY`` a process serves gRPC over TLS with that certificate, and with
``STRATA_GRPC_TLS_CA`` its clients dial every peer over TLS and trust only certificates that CA
signed; ``STRATA_GRPC_TLS_VERIFY_CLIENTS`` makes it mutual (a server accepts only clients that
present a certificate signed by the CA, and clients present their own). Every model process is
both server and client, so give each the same CA and its own certificate, with the address it
advertises (``STRATA_GRPC_HOST``) in the certificate's subjectAltName.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from shared.config import ConfigError, RuntimeSettings


@dataclass(frozen=True)
class GrpcTls:
    cert: bytes = b""
    key: bytes = b""
    ca: bytes = b""
    verify_clients: bool = False

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert)

    @property
    def dials_tls(self) -> bool:
        return bool(self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if self.verify_clients else None,
            require_client_auth=self.verify_clients,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca,
            private_key=self.key or None,
            certificate_chain=self.cert or None,
        )

    @classmethod
    def from_files(
        cls, cert: str = "", key: str = "", ca: str = "", verify_clients: bool = False
    ) -> GrpcTls:
        """Read the PEM files; one line naming the setting when one is missing or unreadable."""
        if bool(cert) != bool(key):
            raise ConfigError(
                "invalid setting STRATA_GRPC_TLS_CERT / STRATA_GRPC_TLS_KEY: give both or neither"
            )
        if verify_clients and not (ca and cert):
            raise ConfigError(
                "invalid setting STRATA_GRPC_TLS_VERIFY_CLIENTS: needs STRATA_GRPC_TLS_CA and "
                "this process's own STRATA_GRPC_TLS_CERT / KEY"
            )
        data = {}
        for name, path in (("cert", cert), ("key", key), ("ca", ca)):
            if not path:
                continue
            try:
                with open(path, "rb") as f:
                    data[name] = f.read()
            except OSError as exc:
                raise ConfigError(
                    f"invalid setting STRATA_GRPC_TLS_{name.upper()}: cannot read {path} "
                    f"({exc.strerror})"
                ) from None
        return cls(**data, verify_clients=verify_clients)

    @classmethod
    def from_env(cls) -> GrpcTls:
        s = RuntimeSettings.from_env()
        return cls.from_files(
            s.grpc_tls_cert, s.grpc_tls_key, s.grpc_tls_ca, s.grpc_tls_verify_clients
        )
