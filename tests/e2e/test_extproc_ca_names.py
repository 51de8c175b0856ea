"""`envoy-config --extproc-ca` checks the certificate's name as well as its chain."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.extproc.tls import ServerTls
from llmgw.sim import ThreadedFleet
from llmgw.testing.extproc import EnvoyProcess, ExtProcThread, fleet_config, loopback_bootstrap

pytestmark = pytest.mark.e2e
JSON = {"content-type": "application/json"}
BODY = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _ca_and_leaf(sans: list[x509.GeneralName]) -> tuple[bytes, ServerTls]:
    """A CA (as cert-manager's ClusterIssuer, a mesh CA) and a leaf it signed for `sans`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("ca")).issuer_name(_name("ca"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder().subject_name(_name("other")).issuer_name(_name("ca"))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ca.public_bytes(pem), ServerTls(cert_pem=leaf.public_bytes(pem), key_pem=key_pem)


def test_extproc_ca_rejects_a_certificate_the_ca_issued_to_another_name(
    sim_fleet: ThreadedFleet, envoy_path: str, tmp_path: Path
) -> None:
    """README: "`--extproc-ca ca.pem` to verify". The generated UpstreamTlsContext had a
    trusted_ca and no SAN matcher (and no SNI): Envoy accepted ANY certificate that CA
    signed, whatever name it carried (found by a review helper). With a shared CA (cert-manager's ClusterIssuer, a mesh
    CA) any workload holding one of its certificates can stand in for llmgw at the address
    and pick every request's endpoint. Control: a leaf for 127.0.0.1 routes (200); a leaf
    for another name must fail closed (5xx) as a stranger CA does."""
    config = fleet_config(sim_fleet)
    cases: list[tuple[list[x509.GeneralName], int]] = [
        ([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], 200),
        ([x509.DNSName("some-other-service.other-ns.svc")], 500),
    ]
    for sans, expected in cases:
        ca_pem, tls = _ca_and_leaf(sans)
        (tmp_path / "ca.pem").write_bytes(ca_pem)
        extproc = ExtProcThread(config, tls=tls)
        try:
            bootstrap = loopback_bootstrap(
                config, extproc.address, shape="original-dst", extproc_ca=str(tmp_path / "ca.pem")
            )
            with EnvoyProcess(bootstrap) as envoy:
                r = httpx.post(
                    envoy.url + "/v1/chat/completions", content=BODY, headers=JSON, timeout=10
                )
                assert r.status_code == expected, (sans, r.status_code, r.text[:200])
        finally:
            extproc.stop()
