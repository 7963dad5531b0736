"""HTTPS with --cert-file/--key-file: browsers allow microphones only on HTTPS or localhost."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from benchmarks.client import make_offer
from benchmarks.latency import spawn_server


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


async def test_serve_over_https(tmp_path: Path) -> None:
    cert_file, key_file = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert_file))
    url, process = await spawn_server(
        "--engine",
        "warp",
        "--cert-file",
        str(cert_file),
        "--key-file",
        str(key_file),
        "--cache-dir",
        str(tmp_path / "cache"),
        tls=trust,
    )
    port = url.rsplit(":", 1)[1]
    assert url.startswith("https://127.0.0.1:")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/readyz", ssl=trust) as r:
                assert r.status == 200
            sdp = await make_offer()
            async with http.post(
                url + "/offer", json={"sdp": sdp, "type": "offer"}, ssl=trust
            ) as r:
                assert r.status == 200
                answer = await r.json()
            assert answer["type"] == "answer" and "a=fingerprint" in answer["sdp"]
            async with http.delete(f"{url}/sessions/{answer['session_id']}", ssl=trust) as r:
                assert r.status == 204
            # Plain HTTP on the TLS port is refused; an untrusted certificate is refused.
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                    await r.read()
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with http.get(url + "/healthz") as r:
                    await r.read()
    finally:
        process.terminate()
        await process.wait()


def test_cert_without_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rtc_server.cli import main

    cert_file, _ = self_signed(tmp_path)
    argv = ["serve", "--cert-file", str(cert_file), "--cache-dir", str(tmp_path)]
    assert main(argv, {}) == 2
    assert "--cert-file and --key-file go together" in capsys.readouterr().err
