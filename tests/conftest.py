"""Shared fixtures: a live in-process server on 127.0.0.1 and the prepared avatar."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from benchmarks.vendor_standin import OPENAI_KEY, VendorServer
from rtc_server.app import MANAGER, SessionManager, create_app
from rtc_server.config import ServerConfig
from rtc_server.engine_factory import EngineFactory, load_engine_factory
from rtc_server.session import PEER_SILENCE_S
from tests.waiting import wait_until

# Servers the tests start (`avatar-rtc serve` subprocesses) are single processes, as before
# `--workers`: its default (one per core) would load the models once per core for each.
# tests/test_workers.py asks for its workers with `--workers 2`.
os.environ.setdefault("AVATAR_RTC_WORKERS", "1")
# The tests' own callers, decoders and models share the machine with the servers they start:
# the load a server would refuse calls for is the test's, not its own. Admission by headroom
# is tested where a test asks for it (tests/test_headroom.py).
os.environ.setdefault("AVATAR_RTC_NO_HEADROOM", "1")
# The servers the tests start answer with `echo`, the deterministic stand-in for an LLM, unless
# a test asks for the local model (tests/test_local_llm*.py) or a cloud stand-in.
os.environ.setdefault("AVATAR_RTC_LLM", "echo")
# Every caller of the tests is on 127.0.0.1: one client address, whose default limit of live
# calls (2) would refuse the tests that hold more. tests/test_hardening.py sets its own.
os.environ.setdefault("AVATAR_RTC_MAX_CALLS_PER_CLIENT", "0")
# Likewise the tests send says and data-channel messages faster than a person does (the fuzz
# tests hundreds a call); tests/test_hardening.py tests the limit.
os.environ.setdefault("AVATAR_RTC_CALL_MESSAGES_PER_MIN", "0")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def engine_factory(cache_dir: Path) -> EngineFactory:
    return load_engine_factory(ServerConfig.of(cache_dir=cache_dir))


@dataclass
class LiveServer:
    url: str
    app: web.Application

    @property
    def manager(self) -> SessionManager:
        return self.app[MANAGER]

    @property
    def video_sent_late_s(self) -> float:
        """How long after its instant this server sends each video frame on purpose: what a
        measurement by arrival takes off the video (``benchmarks.analysis.frame_times``)."""
        return self.manager.config.media.video_send_delay_s


async def start_server(
    engine_factory: EngineFactory, cache_dir: Path, **config: object
) -> tuple[LiveServer, web.AppRunner]:
    # The same text always gives the same audio: what a test hears does not vary run to run.
    config.setdefault("piper_deterministic", True)
    config.setdefault("llm", "echo")  # see AVATAR_RTC_LLM above
    config.setdefault("headroom", False)  # see AVATAR_RTC_NO_HEADROOM above
    config.setdefault("max_calls_per_client", 0)  # see AVATAR_RTC_MAX_CALLS_PER_CLIENT above
    config.setdefault("call_messages_per_min", 0)  # see AVATAR_RTC_CALL_MESSAGES_PER_MIN above
    cfg = ServerConfig.of(cache_dir=cache_dir, ice_addresses=("127.0.0.1",), port=8080, **config)
    app = create_app(cfg, engine_loader=lambda: engine_factory)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    server = LiveServer(f"http://127.0.0.1:{port}", app)
    await wait_until(lambda: server.manager.ready, 30.0, "the server loaded its models")
    return server, runner


@pytest.fixture
async def live_server(engine_factory: EngineFactory, cache_dir: Path) -> AsyncIterator[LiveServer]:
    """The whole server on an ephemeral 127.0.0.1 port, ICE restricted to 127.0.0.1."""
    server, runner = await start_server(engine_factory, cache_dir)
    try:
        yield server
    finally:
        await runner.cleanup()


RESUME_GRACE_S = PEER_SILENCE_S + 5.0
"""The grace of ``resumable_server``: a lost call is noticed after PEER_SILENCE_S (15 s); then
5 s are left to resume it."""


@pytest.fixture
async def chat_vendor() -> AsyncIterator[VendorServer]:
    """The OpenAI stand-in as the LLM: it records every chat request, history included."""
    async with VendorServer(reply_deltas=["Nice to ", "meet you."], speech_seconds=0.3) as v:
        yield v


@pytest.fixture
async def resumable_server(
    engine_factory: EngineFactory, cache_dir: Path, chat_vendor: VendorServer
) -> AsyncIterator[LiveServer]:
    """The server with ``chat_vendor`` as its LLM and calls resumable for RESUME_GRACE_S."""
    live, runner = await start_server(
        engine_factory,
        cache_dir,
        llm="openai",
        openai_api_key=OPENAI_KEY,
        openai_base_url=chat_vendor.openai_base,
        resume_grace_s=RESUME_GRACE_S,
    )
    try:
        yield live
    finally:
        await runner.cleanup()
