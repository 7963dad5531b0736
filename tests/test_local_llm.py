"""The offline default that holds a conversation: a real local model in a process of its own.

With no key in the environment the server answers with Qwen2.5-Coder-0.5B-Instruct through
llama.cpp's server (rtc_server/local_llm), installed by ``make install``: asked by voice, it
says Paris; over ten typed turns its first token stays quick and it keeps the whole history;
killed mid-reply, the caller gets an error and the apology and the next turn is answered by
the restarted model; weights that do not match their hash are refused and ``echo`` answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from benchmarks.analysis import lip_sync
from benchmarks.client import CallClient
from benchmarks.clip import speech_pcm
from benchmarks.latency import connect_caller
from rtc_server.cli import main
from rtc_server.engine_factory import EngineFactory
from rtc_server.local_llm.process import ModelProcess
from rtc_server.local_llm.provider import FIRST_WORDS
from rtc_server.local_llm.weights import QWEN_05B, WeightsRefused, part_file, prepared_model_file
from rtc_server.media.resample import resample_int16
from rtc_server.providers.echo_llm import EchoLLM
from tests.conftest import LiveServer, start_server


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


@pytest.fixture
async def local_server(engine_factory: EngineFactory, cache_dir: Path) -> AsyncIterator[LiveServer]:
    """The server as ``make run`` has it with no key: the local model answers."""
    server, runner = await start_server(engine_factory, cache_dir, llm="auto")
    try:
        yield server
    finally:
        await runner.cleanup()


def model_process(server: LiveServer) -> ModelProcess:
    process = server.manager.model_process
    assert process is not None, f"no local model: {server.manager.choices}"
    return process


async def model_metrics(process: ModelProcess) -> dict[str, float]:
    """The model process's own counters (llama-server's /metrics)."""
    connector = aiohttp.UnixConnector(path=str(process.socket_path))
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.get("http://localhost/metrics") as response:
            text = await response.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.removeprefix("llamacpp:")] = float(value)
    return values


async def model_post(process: ModelProcess, path: str, body: object) -> dict[str, object]:
    connector = aiohttp.UnixConnector(path=str(process.socket_path))
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.post(f"http://localhost{path}", json=body) as response:
            assert response.status == 200, await response.text()
            answer: dict[str, object] = await response.json()
            return answer


async def typed_turn(client: CallClient, text: str, timeout: float = 60) -> tuple[str, dict]:
    """Type ``text``; the reply's text and the turn's metrics once it was spoken."""
    first = len(client.events)
    client.channel.send(json.dumps({"type": "text", "text": text}))
    turn = await client.wait_event(lambda e: e.get("type") == "turn", timeout)
    await client.wait_state("listening", 30)
    later = client.events[first:]
    errors = [e for e in later if e.get("type") == "error"]
    assert not errors, errors
    reply = " ".join(e["text"] for e in later if e.get("type") == "response")
    return reply, turn["metrics"]


@pytest.fixture(scope="module")
def whisper():  # type: ignore[no-untyped-def]
    from rtc_server.providers.whisper_stt import WhisperSTT

    return WhisperSTT.load(threads=2)


async def test_asked_by_voice_the_local_model_says_paris(local_server: LiveServer, whisper) -> None:  # type: ignore[no-untyped-def]
    manager = local_server.manager
    llm = next(c for c in manager.choices if c.slot == "llm")
    assert llm.name == "local" and "no cloud key" in llm.reason, manager.choices
    process = model_process(local_server)
    predicted = (await model_metrics(process))["tokens_predicted_total"]

    client, mic = await connect_caller(local_server.url)
    try:
        audio_start, video_start = len(client.received.audio), len(client.received.video)
        mic.play(await speech_pcm("Which city is the capital of France?"))
        transcript = await client.wait_event(lambda e: e.get("type") == "transcript", 15)
        assert {"capital", "france"} <= set(words(transcript["text"])), transcript
        await client.wait_event(lambda e: e.get("type") == "turn", 60)
        await client.wait_state("listening", 30)
        await asyncio.sleep(0.3)
        pieces = [e["text"] for e in client.events if e.get("type") == "response"]
        reply = " ".join(pieces)
        audio = client.received.audio[audio_start:]
        video = client.received.video[video_start:]
    finally:
        await client.close()

    assert "paris" in words(reply), reply
    assert not reply.startswith("You said"), reply
    # Its first words were spoken without waiting for the whole sentence to be written.
    assert manager.settings.first_words == FIRST_WORDS
    assert len(pieces) >= 2 and len(pieces[0].split()) < len(reply.split()), pieces
    # The words came from the model process: it generated them.
    assert (await model_metrics(process))["tokens_predicted_total"] > predicted
    # The caller heard the answer, and the avatar's mouth moved with it.
    pcm = np.concatenate([p for _, _, p in audio])
    heard = words(await whisper.transcribe(resample_int16(pcm, 48_000, 16_000), 16_000))
    assert "paris" in heard, heard
    box = manager.engine_factory.mouth_box  # type: ignore[union-attr]
    assert box is not None
    sync = lip_sync(video, audio, box, video_sent_late_s=local_server.video_sent_late_s)
    assert sync.correlation >= 0.5 and abs(sync.offset_ms) <= 40, sync


TEN_TURNS = (
    "Hi, my name is Sam.",
    "What is the capital of Italy?",
    "Who wrote Hamlet?",
    "What is two plus two?",
    "Name a fruit that is yellow.",
    "What is the largest planet?",
    "How many legs does a spider have?",
    "What colour is a clear sky?",
    "What do bees make?",
    "What is my name?",
)


async def test_ten_typed_turns_keep_the_first_token_quick_and_the_history_whole(
    local_server: LiveServer,
) -> None:
    process = model_process(local_server)
    before = await model_metrics(process)
    client = CallClient(local_server.url, record_video=False)
    await client.connect()
    try:
        await client.wait_channel_open()
        await client.wait_state("listening", 10)
        replies, first_tokens = [], []
        for text in TEN_TURNS:
            reply, metrics = await typed_turn(client, text)
            replies.append(reply)
            first_tokens.append(metrics["llm_first_token_ms"])
        session = local_server.manager.sessions[client.session_id]
        messages = session.turns.conversation.messages()
    finally:
        await client.close()
    after = await model_metrics(process)
    written = after["tokens_predicted_total"] - before["tokens_predicted_total"]
    writing_s = after["tokens_predicted_seconds_total"] - before["tokens_predicted_seconds_total"]
    print("first tokens (ms):", first_tokens)
    print(f"written: {written:.0f} tokens at {written / writing_s:.1f} a second")
    print("replies:", replies)

    second = first_tokens[1]
    assert all(ms <= 2 * second for ms in first_tokens), (first_tokens, second)
    # The history as the call holds it: the system prompt, then every turn in order.
    assert [m.content for m in messages if m.role == "user"] == list(TEN_TURNS)
    assert [m.content for m in messages if m.role == "assistant"] == replies
    # The model kept it too: told the name at the first turn, it says it at the tenth.
    assert "sam" in words(replies[-1]), replies[-1]
    # ...and read each token of it once: what it read over the ten turns is no more than the
    # last prompt (the replies it wrote itself it never read again), not a re-read history.
    wire = [{"role": m.role, "content": m.content} for m in messages]
    prompt = await model_post(process, "/apply-template", {"messages": wire})
    tokens = await model_post(process, "/tokenize", {"content": prompt["prompt"]})
    last_prompt = len(tokens["tokens"])  # type: ignore[arg-type]
    read = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert read <= last_prompt, (read, last_prompt)


COUNTING = "Write the numbers from one to forty in words, separated by commas."


async def writing(process: ModelProcess, tokens: int, timeout_s: float = 30.0) -> None:
    """Until the model has written ``tokens`` tokens of the reply in progress (its /slots)."""
    connector = aiohttp.UnixConnector(path=str(process.socket_path))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(connector=connector) as http:
        while loop.time() < deadline:
            async with http.get("http://localhost/slots") as response:
                slots = await response.json()
            decoded = [
                n["n_decoded"] for s in slots if s.get("is_processing") for n in s["next_token"]
            ]
            if any(n >= tokens for n in decoded):
                return
            await asyncio.sleep(0.01)
    raise TimeoutError(f"the model wrote no {tokens} tokens in {timeout_s} s")


async def test_a_killed_model_process_costs_one_reply_and_is_restarted(  # type: ignore[no-untyped-def]
    local_server: LiveServer, whisper
) -> None:
    process = model_process(local_server)
    client = CallClient(local_server.url, record_video=False)
    await client.connect()
    try:
        await client.wait_channel_open()
        await client.wait_state("listening", 10)
        # A long answer (the model counts to fourteen, about 40 tokens): killed once it has
        # written a few of them, so the reply has begun and cannot be asked for again.
        client.channel.send(json.dumps({"type": "text", "text": COUNTING}))
        await writing(process, tokens=4)
        pid = process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        error = await client.wait_event(lambda e: e.get("type") == "error", 15)
        after_error = len(client.received.audio)
        await client.wait_event(lambda e: e.get("type") == "turn", 30)
        await client.wait_state("listening", 30)
        await asyncio.sleep(0.5)
        assert error["code"] in ("connection", "bad_response"), error
        # Then the apology, in the local voice.
        pcm = np.concatenate([p for _, _, p in client.received.audio[after_error:]])
        heard = words(await whisper.transcribe(resample_int16(pcm, 48_000, 16_000), 16_000))
        assert {"sorry", "problem"} <= set(heard), heard
        # The next turn is answered by the restarted model.
        reply, _ = await typed_turn(client, "What is the capital of Italy?")
        assert "rome" in words(reply), reply
        assert process.restarts == 1 and process.pid not in (None, pid)
        assert client.session_id in local_server.manager.sessions
    finally:
        await client.close()


def _fake_part(site: Path, index: int) -> Path:
    """``site`` gets an installed copy of part ``index`` with one byte changed, found before
    the real one on ``sys.path``."""
    part = QWEN_05B.parts[index]
    module = part.path.split("/", 1)[0]
    info = site / f"{module}-0.9.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {part.package}\nVersion: 0.9.0\n")
    data = site / part.path
    data.parent.mkdir(parents=True)
    shutil.copyfile(part_file(part), data)
    with data.open("r+b") as f:
        f.seek(12_345)
        byte = f.read(1)
        f.seek(12_345)
        f.write(bytes([byte[0] ^ 0x01]))
    return data


def test_a_part_that_does_not_match_is_refused_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = _fake_part(tmp_path / "site", 2)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(WeightsRefused, match=re.escape(str(bad))):
        prepared_model_file(tmp_path / "cache")
    # Nothing was left where the model is loaded from.
    assert not QWEN_05B.cached_file(tmp_path / "cache").exists()
    assert not list((tmp_path / "cache" / "models").iterdir())


def test_a_cached_file_that_does_not_match_is_put_together_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = prepared_model_file(tmp_path)
    with good.open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 16)
    with caplog.at_level(logging.WARNING):
        again = prepared_model_file(tmp_path)
    assert again == good
    assert any(str(good) in r.getMessage() for r in caplog.records), caplog.text
    from rtc_server.local_llm.weights import file_sha256

    assert file_sha256(good) == QWEN_05B.sha256


async def test_weights_that_do_not_match_fall_back_to_echo_in_the_log_and_in_doctor(
    engine_factory: EngineFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = _fake_part(tmp_path / "site", 4)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with caplog.at_level(logging.ERROR):
        server, runner = await start_server(engine_factory, tmp_path / "cache", llm="auto")
    try:
        assert server.manager.model_process is None
        assert isinstance(server.manager.providers.llm, EchoLLM)  # type: ignore[union-attr]
        llm = next(c for c in server.manager.choices if c.slot == "llm")
        assert llm.name == "echo" and str(bad) in llm.reason, llm
        assert any(str(bad) in r.getMessage() for r in caplog.records), caplog.text
        client = CallClient(server.url, record_video=False)
        await client.connect()
        try:
            await client.wait_channel_open()
            await client.wait_state("listening", 10)
            reply, _ = await typed_turn(client, "are you there")
            assert reply == "You said: are you there."
        finally:
            await client.close()
    finally:
        await runner.cleanup()

    monkeypatch.delenv("AVATAR_RTC_LLM", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.setenv("AVATAR_RTC_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["doctor"], {}) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("llm:"))
    assert line.startswith("llm: echo") and str(bad) in line, line


def comm(pid: int) -> str | None:
    """A process's name, or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


async def test_the_workers_share_one_model_process_which_stops_with_the_front(
    tmp_path: Path,
) -> None:
    from tests.test_workers import _children, _get, _spawn_front, _stop

    url, front = await _spawn_front(tmp_path / "front.log", "--llm", "local")
    clients = [CallClient(url, record_video=False) for _ in range(2)]
    try:
        children = {pid: comm(pid) for pid in _children(front.pid)}
        models = [pid for pid, name in children.items() if name == "llama-server"]
        assert len(models) == 1 and len(children) == 3, children  # two workers, one model
        for client in clients:  # the front gives each call to the worker with the fewest
            await client.connect()
            await client.wait_channel_open()
            await client.wait_state("listening", 10)
        _, ready, _ = await _get(url + "/readyz")
        assert [w["sessions"] for w in ready["workers"]] == [1, 1], ready
        for client in clients:
            reply, _ = await typed_turn(client, "What is the capital of Italy?")
            assert "rome" in words(reply), reply
    finally:
        for client in clients:
            await client.close()
        await _stop(front)
    assert comm(models[0]) is None, "the model process outlived the front"
