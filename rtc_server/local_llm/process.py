"""The machine's one model process: llama.cpp's ``llama-server`` on a unix socket.

One process answers every call of the server, whatever its number of workers: the single
process server starts it itself, the front of ``--workers N`` starts it before the workers and
hands them its socket (``config.conversation.local_model_socket``). It is started with the
server, watched (one that dies is started again on the same socket, at once the first time,
then after a wait that doubles while it keeps dying young), and stopped after the calls.

Its settings are the ones measured on two cores (docs/DECISIONS.md, "A local model"): two
threads generate (27 tokens a second against 15 on one; end of speech to first reply audio
p50 1.18 s against 1.46 s) at nice +5, below the calls' media, which stayed smooth beside it;
each of ``SLOTS`` conversations keeps its prompt in the model's memory, so a turn reads only
what was added since the last one, and a conversation that lost its slot gets its prompt back
from a cache in RAM (``--cache-ram``) rather than read again.
Nothing is loaded from the network: ``llama-server`` is built by ``make install`` from the
llama.cpp sources in the pinned ``llama-cpp-python`` sdist, the weights are checked
(``weights.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from musetalk_core.types import AvatarRtcError
from rtc_server.child_processes import stop_processes
from rtc_server.cpu_priority import SPEECH_NICE
from rtc_server.local_llm.weights import QWEN_05B, prepared_model_file

logger = logging.getLogger(__name__)

BINARY = "llama-server"
SLOTS = 4
"""Conversations the model keeps in its memory at once (and generates for side by side)."""
CONTEXT_PER_SLOT = 4096
"""Tokens of one conversation's prompt and reply: the history budget (6,000 characters, about
1,500 tokens) with room to spare."""
CACHE_RAM_MIB = 256
"""Prompts of conversations that lost their slot, kept in RAM (about 12 KiB a token)."""
THREADS = 2
BATCH_THREADS = 2
READY_TIMEOUT_S = 120.0
RESTART_S = 0.5
"""The wait before a model process that died young is started again; it doubles each time
it dies within LIVED_LONG_S of its start, up to MAX_RESTART_S. The first death of a process
that lived long is restarted at once."""
LIVED_LONG_S = 60.0
MAX_RESTART_S = 30.0
STOP_S = 10.0
LOG_LINES = 40
_TICKS = os.sysconf("SC_CLK_TCK")
SOCKET_DIR_PREFIX = "avatar-rtc-model-"


class ModelProcessError(AvatarRtcError, RuntimeError):
    """The model process could not be started or did not become ready."""


def find_binary() -> Path | None:
    """``llama-server`` beside this Python (``make install`` puts it in the venv), else on
    PATH."""
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    return Path(found) if found else None


def socket_dir() -> Path:
    """A new folder for the model's socket that only this user can enter (0700)."""
    return Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))


def model_settings(cache_dir: Path, socket_path: Path) -> ModelSettings:
    """The default model's process, on ``socket_path``; its weights put together and checked
    (blocking). Raises ``WeightsRefused`` or :class:`ModelProcessError`, saying why."""
    binary = find_binary()
    if binary is None:
        raise ModelProcessError(f"{BINARY} is not installed (make install builds it)")
    return ModelSettings(prepared_model_file(cache_dir, QWEN_05B), socket_path, binary)


@dataclass(frozen=True, slots=True)
class ModelSettings:
    model_file: Path
    socket_path: Path
    binary: Path
    threads: int = THREADS
    batch_threads: int = BATCH_THREADS
    slots: int = SLOTS
    context_per_slot: int = CONTEXT_PER_SLOT
    cache_ram_mib: int = CACHE_RAM_MIB

    def command(self) -> list[str]:
        return [
            # Below the media path, as transcription is (rtc_server/cpu_priority.py): the
            # model gets the CPU the calls' audio and video leave.
            "nice",
            "-n",
            str(SPEECH_NICE),
            str(self.binary),
            "--model",
            str(self.model_file),
            # A host ending in .sock is a unix socket; the port is then ignored.
            "--host",
            str(self.socket_path),
            "--port",
            "1",
            "--threads",
            str(self.threads),
            "--threads-batch",
            str(self.batch_threads),
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(self.slots * self.context_per_slot),
            "--cache-ram",
            str(self.cache_ram_mib),
            "--no-webui",
            "--metrics",
            "--jinja",
            "--log-verbosity",
            "2",
        ]


def model_client(socket_path: Path | str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path)))


async def warm(socket_path: Path, system_prompt: str) -> None:
    """Read ``system_prompt`` into the model's memory, so that a call's first turn reads only
    what follows it, and page the weights in before anyone waits for them."""
    body = {
        "messages": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": "Hello."},
        ],
        "max_tokens": 1,
        "temperature": 0.0,
    }
    async with model_client(socket_path) as http:
        async with http.post("http://localhost/v1/chat/completions", json=body) as response:
            await response.read()
            if response.status != 200:
                logger.warning("the local model's warm-up got HTTP %d", response.status)


async def wait_ready(socket_path: Path, timeout_s: float, alive: Callable[[], bool]) -> None:
    """Until ``/health`` answers 200 (the model is loaded), ``alive()`` turns false
    (ModelProcessError) or ``timeout_s`` passes (ModelProcessError)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with model_client(socket_path) as http:
        while loop.time() < deadline:
            if not alive():
                raise ModelProcessError("the model process exited while loading")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get("http://localhost/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise ModelProcessError(f"the model process was not ready after {timeout_s:.0f} s")


class ModelProcess:
    """Starts ``llama-server``, restarts it when it dies, stops it; see the module docstring.

    Each process, once loaded, reads ``warm_prompt`` (the calls' system prompt) before it is
    called ready; ``on_restart`` is called each time one died and is started again.
    """

    def __init__(
        self,
        settings: ModelSettings,
        *,
        warm_prompt: str,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self._warm_prompt = warm_prompt
        self._on_restart = on_restart
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self._log: deque[str] = deque(maxlen=LOG_LINES)
        self._cpu_before = 0.0
        """CPU seconds of the processes that died."""
        self._cpu_now = 0.0

    @property
    def pid(self) -> int | None:
        process = self.process
        return process.pid if process is not None and process.returncode is None else None

    @property
    def socket_path(self) -> Path:
        return self.settings.socket_path

    def cpu_seconds(self) -> float:
        """CPU time of every model process so far (those that died: as last read)."""
        pid = self.pid
        if pid is not None:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                self._cpu_now = (int(fields[11]) + int(fields[12])) / _TICKS
            except (OSError, IndexError, ValueError):
                pass
        return self._cpu_before + self._cpu_now

    async def start(self) -> None:
        """Start the process and wait until it is ready; then watch it in the background."""
        await self._spawn()
        try:
            await self._until_ready()
        except ModelProcessError:
            await self.stop()
            raise
        self._task = asyncio.ensure_future(self._watch())

    async def _spawn(self) -> None:
        self.ready.clear()
        self._cpu_before += self._cpu_now
        self._cpu_now = 0.0
        with contextlib.suppress(FileNotFoundError):
            self.settings.socket_path.unlink()  # a dead process's socket
        self.process = await asyncio.create_subprocess_exec(
            *self.settings.command(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # signalled by its owner alone, after the calls
        )
        assert self.process.stderr is not None
        self._relay_task = asyncio.ensure_future(self._relay(self.process.stderr))
        logger.info("model process started (pid %d)", self.process.pid)

    async def _until_ready(self) -> None:
        process = self.process
        assert process is not None
        try:
            await wait_ready(
                self.settings.socket_path, READY_TIMEOUT_S, lambda: process.returncode is None
            )
        except ModelProcessError as exc:
            await asyncio.sleep(0.1)  # its last words
            last = " | ".join(list(self._log)[-5:])
            raise ModelProcessError(f"{exc}: {last}") from None
        try:
            await warm(self.settings.socket_path, self._warm_prompt)
        except (aiohttp.ClientError, OSError) as exc:
            logger.warning("the local model's warm-up failed: %s", exc)
        self.ready.set()
        logger.info("model process ready (pid %d)", process.pid)

    async def _relay(self, stream: asyncio.StreamReader) -> None:
        """Its log, kept (the last lines explain a failed start) and passed on at debug level."""
        while line := await stream.readline():
            text = line.decode("utf-8", "replace").rstrip()
            self._log.append(text)
            logger.debug("llama-server: %s", text)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        young_deaths = 0
        while not self._stopping:
            process = self.process
            assert process is not None
            started = loop.time()
            code = await process.wait()
            if self._stopping:
                return
            self.ready.clear()
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart()
            young_deaths = young_deaths + 1 if loop.time() - started < LIVED_LONG_S else 0
            delay = 0.0 if young_deaths <= 1 else min(MAX_RESTART_S, RESTART_S * 2**young_deaths)
            how = f"signal {-code}" if code < 0 else f"code {code}"
            logger.error(
                "model process (pid %d) died (%s); restarting in %.1f s", process.pid, how, delay
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                await self._spawn()
                await self._until_ready()
            except (ModelProcessError, OSError):
                logger.exception("the model process did not come back")
                if self.process is not None and self.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.process.kill()  # hung while loading: the loop starts another

    async def stop(self) -> None:
        self._stopping = True
        if self.process is not None:
            await stop_processes([self.process], STOP_S)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.settings.socket_path.unlink()
        folder = self.settings.socket_path.parent
        if folder.name.startswith(SOCKET_DIR_PREFIX):  # made by socket_dir() for it alone
            with contextlib.suppress(OSError):
                folder.rmdir()
