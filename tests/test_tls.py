"""HTTPS with --cert-file/--key-file: browsers allow microphones only on HTTPS or localhost."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import make_offer
from benchmarks.latency import spawn_server
from tests.certs import self_signed


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
