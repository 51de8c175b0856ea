"""TLS for the ext_proc gRPC server: the given cert/key files, or a self-signed pair made at
start (like GIE's endpoint picker, whose gateways connect with TLS and no verification).

The pair is generated in memory with `cryptography` (EC P-256: ~1 ms, vs ~50 ms for RSA 2048)
and never written to disk.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.errors import ConfigError

SELF_SIGNED_DAYS = 365


@dataclass(frozen=True, slots=True)
class ServerTls:
    """PEM bytes of the server certificate (chain) and its private key."""

    cert_pem: bytes
    key_pem: bytes
    self_signed: bool = False

    @classmethod
    def from_files(cls, cert_file: str, key_file: str) -> ServerTls:
        """Read the pair; ConfigError naming the file and flag when one cannot be read."""
        pems: list[bytes] = []
        for flag, name in (("--tls-cert", cert_file), ("--tls-key", key_file)):
            try:
                data = Path(name).read_bytes()
            except OSError as exc:
                raise ConfigError([f"cannot read {name!r}: {exc.strerror}"], flag) from exc
            if b"-----BEGIN " not in data:
                raise ConfigError([f"{name!r} is not a PEM file"], flag)
            pems.append(data)
        _check_pair(pems[0], pems[1], cert_file, key_file)
        return cls(cert_pem=pems[0], key_pem=pems[1])

    @classmethod
    def self_signed_pair(cls, hostname: str = "llmgw-extproc") -> ServerTls:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName(hostname),
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(
            cert_pem=cert.public_bytes(serialization.Encoding.PEM),
            key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            self_signed=True,
        )

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials; ConfigError on PEM gRPC cannot read (`from_files` has
        checked that the key is the certificate's: gRPC would only fail at bind)."""
        try:
            return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])
        except Exception as exc:  # grpc raises bare RuntimeError/ValueError on bad PEM
            raise ConfigError([f"certificate/key rejected: {exc}"], "TLS") from exc


def _public(key: Any) -> bytes:
    data: bytes = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return data


def _check_pair(cert_pem: bytes, key_pem: bytes, cert_file: str, key_file: str) -> None:
    """ConfigError unless `key_pem` is the unencrypted private key of the first certificate
    in `cert_pem` (gRPC takes any PEM, then fails at bind: "Failed to bind to address")."""
    try:
        certificate = x509.load_pem_x509_certificates(cert_pem)[0]
    except ValueError as exc:
        raise ConfigError(
            [f"{cert_file!r}: no PEM certificate in it ({exc})"], "--tls-cert"
        ) from exc
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # TypeError: encrypted
        raise ConfigError(
            [f"{key_file!r}: no unencrypted PEM private key in it ({exc})"], "--tls-key"
        ) from exc
    if _public(key.public_key()) != _public(certificate.public_key()):
        raise ConfigError(
            [f"{key_file!r} is not the private key of the certificate in {cert_file!r}"],
            "--tls-key",
        )
