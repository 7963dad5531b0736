"""The front's MuseTalk engine processes: one per GPU, shared by every media worker.

When the server runs MuseTalk behind several media workers, the front starts one
``musetalk_core.engine_server`` process per device before the workers, hands each worker the
socket of one (``config.engine.musetalk_engine_socket``, worker i on device i mod n), restarts
one that dies (its calls go on with the CPU engine; new calls render again once it is back)
and stops them after the workers have drained.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from rtc_server.child_processes import stop_processes
from rtc_server.config import ServerConfig

logger = logging.getLogger(__name__)

RESTART_S = 2.0
"""The wait before an engine process that died is started again; it doubles while it keeps
dying within LIVED_LONG_S of its start (bad weights, a GPU gone), up to MAX_RESTART_S."""
LIVED_LONG_S = 60.0
MAX_RESTART_S = 60.0
STOP_S = 30.0


def engine_devices(config: ServerConfig) -> list[str]:
    """The devices to run an engine process on: none unless MuseTalk is the engine."""
    if config.engine.name not in ("auto", "musetalk"):
        return []
    from rtc_server.engine_factory import musetalk_choice

    use, _ = musetalk_choice(config)
    if not use:
        return []
    device = config.engine.musetalk_device
    if device not in ("auto", "cuda"):
        return [device]  # cuda:N or cpu
    import torch

    count = torch.cuda.device_count()
    return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]


@dataclass
class _Engine:
    device: str
    socket_path: str
    process: asyncio.subprocess.Process | None = None


class EngineProcesses:
    """Starts, restarts and stops the engine processes; see the module docstring."""

    def __init__(
        self,
        config: ServerConfig,
        devices: list[str],
        socket_dir: str,
        *,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self._on_restart = on_restart
        self.engines = [
            _Engine(d, os.path.join(socket_dir, f"engine-{i}.sock")) for i, d in enumerate(devices)
        ]
        self.restarts = 0
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def socket_for(self, worker_index: int) -> str:
        return self.engines[worker_index % len(self.engines)].socket_path

    def start(self) -> None:
        for engine in self.engines:
            self._tasks.append(asyncio.ensure_future(self._run(engine)))

    async def _run(self, engine: _Engine) -> None:
        e, s = self.config.engine, self.config.server
        from rtc_server.engine_factory import weights_dir

        args = [
            "--socket",
            engine.socket_path,
            "--weights-dir",
            str(weights_dir(self.config)),
            "--cache-dir",
            str(s.cache_dir / "musetalk-avatars"),
            "--device",
            engine.device,
            "--batch",
            str(e.musetalk_batch),
            "--framing",
            e.framing,
        ]
        if e.avatar is not None:
            args += ["--avatar", str(e.avatar)]
        if e.musetalk_compile:
            args.append("--compile")
        loop = asyncio.get_running_loop()
        young_deaths = 0
        while not self._stopping:
            started = loop.time()
            engine.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "musetalk_core.engine_server",
                *args,
                stdout=asyncio.subprocess.DEVNULL,
                start_new_session=True,  # signalled by the front alone, after the workers
            )
            logger.info(
                "MuseTalk engine process on %s started (pid %d)", engine.device, engine.process.pid
            )
            code = await engine.process.wait()
            if self._stopping:
                return
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart()
            young_deaths = young_deaths + 1 if loop.time() - started < LIVED_LONG_S else 0
            delay = min(MAX_RESTART_S, RESTART_S * 2 ** max(0, young_deaths - 1))
            logger.error(
                "MuseTalk engine process on %s died (%s); restarting in %.0f s",
                engine.device,
                code,
                delay,
            )
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        self._stopping = True
        await stop_processes([e.process for e in self.engines if e.process], STOP_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
