"""The worker processes: start, watch, restart, drain; which worker holds which call.

Calls are tracked from the front's own traffic (an answered ``/offer`` adds its session to the
worker, a ``DELETE`` removes it) and corrected once a second from each worker's status (calls
that ended by themselves). A worker that dies is logged, counted
(``avatar_rtc_worker_restarts_total``) and started again, after a back-off when it keeps
dying young; its calls died with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import resource
import secrets
import shutil
import signal
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from rtc_server.config import ServerConfig
from rtc_server.headroom import Headroom, MachineCpu, Refusal, WorkerLoad, machine_refusal
from rtc_server.local_llm.process import ModelProcess, ModelProcessError, model_settings
from rtc_server.local_llm.weights import WeightsRefused
from rtc_server.workers.engines import EngineProcesses, engine_devices
from rtc_server.workers.protocol import STATUS_PATH, STATUS_SECRET, WorkerSpec

logger = logging.getLogger(__name__)

POLL_S = 1.0
STATUS_TIMEOUT_S = 2.0
LIVED_LONG_S = 30.0
"""A worker that dies younger than this counts as dying young: the next start waits longer."""
MAX_BACKOFF_S = 30.0
HUNG_AFTER_S = 15.0
"""A worker that answered its status polls once and then none for this long is stuck (an event
loop that stalls for 15 s serves no call): it is killed, and restarted like one that died."""
KILL_AFTER_DRAIN_S = 15.0
"""A worker still running this long after its drain timeout is killed."""
ENDED_KEPT = 10_000


@dataclass
class Status:
    pid: int
    ready: bool
    draining: bool
    load_error: str | None
    sessions: list[str]
    cpu_cores: float = 0.0
    """Cores it used over its headroom window."""
    idle_cpu: float = 0.0
    speaking_call_cpu: float = 0.0
    cpu_limit: float = 0.0


@dataclass
class Worker:
    index: int
    socket_path: str
    process: asyncio.subprocess.Process | None = None
    http: aiohttp.ClientSession | None = None
    status: Status | None = None
    """The last status it answered; None until its HTTP server is up (and once it died)."""
    sessions: dict[str, float] = field(default_factory=dict)
    """Calls it holds, as far as the front knows: session id -> when added (loop time)."""
    inflight: int = 0
    """Offers forwarded to it and not answered yet."""
    started_at: float = 0.0
    young_deaths: int = 0
    answered_at: float | None = None
    """Loop time of its last status answer; None until its first."""

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def ready(self) -> bool:
        return self.alive and self.status is not None and self.status.ready

    @property
    def load(self) -> int:
        return len(self.sessions) + self.inflight

    def rss_mb(self) -> float | None:
        if not self.alive or self.process is None:
            return None
        return rss_mb(self.process.pid)


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process, in MB (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize() / 1e6
    except (OSError, ValueError, IndexError):
        return None


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "avatar_rtc_worker_restarts",
            "Worker processes that died and were started again (their calls ended).",
            registry=self.registry,
        )
        self.workers = Gauge(
            "avatar_rtc_workers", "Worker processes running.", registry=self.registry
        )
        self.workers_ready = Gauge(
            "avatar_rtc_workers_ready", "Worker processes ready for calls.", registry=self.registry
        )
        self.engine_restarts = Counter(
            "avatar_rtc_engine_restarts",
            "MuseTalk engine processes that died and were started again.",
            registry=self.registry,
        )
        self.model_restarts = Counter(
            "avatar_rtc_model_restarts",
            "Local model processes that died and were started again.",
            registry=self.registry,
        )
        self.hangs = Counter(
            "avatar_rtc_worker_hangs",
            f"Workers killed for answering no status poll for {HUNG_AFTER_S:.0f} s.",
            registry=self.registry,
        )
        self.machine_refusals = Counter(
            "avatar_rtc_machine_refusals",
            "Calls the front refused (503 at_capacity) for want of room on the machine: every "
            "worker's calls and the new one speaking, with what else the machine runs.",
            registry=self.registry,
        )


class WorkerPool:
    def __init__(self, config: ServerConfig, count: int, *, verbose: int = 0) -> None:
        self.config = config
        self.verbose = verbose
        self.metrics = FrontMetrics()
        self.socket_dir = tempfile.mkdtemp(prefix="avatar-rtc-")  # 0700: the front's alone
        self.workers = [
            Worker(i, os.path.join(self.socket_dir, f"worker-{i}.sock")) for i in range(count)
        ]
        self.ended: OrderedDict[str, int] = OrderedDict()
        """Calls of workers that died: session id -> worker index (the last ENDED_KEPT)."""
        self.secret = secrets.token_hex(16)
        """Opens the workers' status route; never leaves the front and its workers."""
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._round_robin = 0
        self.machine = MachineCpu()
        """The machine's busy cores, sampled at each status poll."""
        devices = engine_devices(config) if count > 1 else []
        self.engines = (
            EngineProcesses(
                config, devices, self.socket_dir, on_restart=self.metrics.engine_restarts.inc
            )
            if devices
            else None
        )
        """MuseTalk's engine processes, one per GPU, when the workers render with MuseTalk."""
        self.model: ModelProcess | None = None
        """The local model's one process, when the workers answer with it."""
        self.worker_config = config
        """What the workers are told: ``config`` and the model process's socket."""

    # -- start-up

    async def start_first(self) -> int | None:
        """Start worker 0 and wait until it serves HTTP (its portrait and settings are good,
        its models load in the background); its exit code if it stopped instead."""
        worker = self.workers[0]
        if self.engines is not None:
            self.engines.start()  # its models load while the workers start
        await self._start_model()
        await self._spawn(worker)
        assert worker.process is not None
        while worker.status is None:
            if worker.process.returncode is not None:
                await asyncio.sleep(0.2)  # the relay prints its last words
                return worker.process.returncode
            worker.status = await self.fetch_status(worker)
            await asyncio.sleep(0.1)
        self._spawn_task(self._watch(worker, worker.process))
        self._spawn_task(self._poll())
        return None

    async def _start_model(self) -> None:
        """The machine's one local model process, shared by the workers' calls, when they
        answer with it; ``echo`` answers when it cannot start."""
        from rtc_server.providers.registry import choose
        from rtc_server.turns import DEFAULT_SYSTEM_PROMPT

        conversation = self.config.conversation
        if conversation.mode != "pipeline" or choose(self.config)[1].name != "local":
            return
        loop = asyncio.get_running_loop()
        socket = Path(self.socket_dir) / "model.sock"
        try:
            settings = await loop.run_in_executor(
                None, model_settings, self.config.server.cache_dir, socket
            )
            process = ModelProcess(
                settings,
                warm_prompt=conversation.system_prompt or DEFAULT_SYSTEM_PROMPT,
                on_restart=self.metrics.model_restarts.inc,
            )
            await process.start()
        except (WeightsRefused, ModelProcessError, OSError) as exc:
            logger.error("the local model was refused, the workers answer with echo: %s", exc)
            self.worker_config = self.config.replace(llm="echo")
            return
        self.model = process
        self.worker_config = self.config.replace(local_model_socket=socket)

    def start_rest(self) -> None:
        """The others, once the first has prepared the avatar (they find it in the cache)."""
        for worker in self.workers[1:]:
            self._spawn_task(self._start(worker))

    async def _start(self, worker: Worker) -> None:
        try:
            await self._spawn(worker)
        except OSError:  # no fork, no memory: try again later, as for a worker that died
            logger.exception("worker %d could not be started", worker.index)
            await asyncio.sleep(MAX_BACKOFF_S)
            if not self.draining:
                self._spawn_task(self._start(worker))
            return
        assert worker.process is not None
        self._spawn_task(self._watch(worker, worker.process))

    async def _spawn(self, worker: Worker) -> None:
        # Each worker judges its own headroom against its share of the machine's cores.
        cpu_limit = self.config.server.cpu_limit or Headroom.default_cpu_limit(len(self.workers))
        engine = self.engines.socket_for(worker.index) if self.engines is not None else None
        spec = WorkerSpec(
            self.worker_config.replace(
                cpu_limit=cpu_limit,
                musetalk_engine_socket=None if engine is None else Path(engine),
            ),
            worker.socket_path,
            worker.index,
            os.getpid(),
            self.secret,
            self.verbose,
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rtc_server.workers.child",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            # Its own session: a Ctrl-C in the terminal reaches the front alone, which then
            # drains every worker once (a worker signalled twice would cut its drain short).
            start_new_session=True,
        )
        assert process.stdin is not None and process.stderr is not None
        process.stdin.write(pickle.dumps(spec))
        with contextlib.suppress(ConnectionError):
            await process.stdin.drain()
        process.stdin.close()
        worker.process = process
        worker.status = None
        worker.started_at = asyncio.get_running_loop().time()
        worker.answered_at = None
        worker.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=worker.socket_path), auto_decompress=False
        )
        self._spawn_task(_relay(worker.index, process.stderr))
        logger.info("worker %d started (pid %d)", worker.index, process.pid)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- watching

    async def _watch(self, worker: Worker, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        loop = asyncio.get_running_loop()
        lived = loop.time() - worker.started_at
        if worker.http is not None:
            await worker.http.close()
            worker.http = None
        worker.status = None
        lost = list(worker.sessions)
        worker.sessions.clear()
        if self.draining:
            logger.info("worker %d (pid %d) exited with %s", worker.index, process.pid, code)
            return
        for session_id in lost:
            self.ended[session_id] = worker.index
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        worker.young_deaths = worker.young_deaths + 1 if lived < LIVED_LONG_S else 0
        delay = min(MAX_BACKOFF_S, 0.5 * 2**worker.young_deaths)
        how = f"signal {-code}" if code < 0 else f"code {code}"
        logger.error(
            "worker %d (pid %d) died (%s) after %.0f s; its %d calls ended; restarting in %.1f s",
            worker.index,
            process.pid,
            how,
            lived,
            len(lost),
            delay,
        )
        self.metrics.restarts.inc()
        await asyncio.sleep(delay)
        if not self.draining:
            await self._start(worker)

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self.refresh(w) for w in self.workers if w.alive))
            self.machine.sample()
            self.metrics.workers.set(sum(w.alive for w in self.workers))
            self.metrics.workers_ready.set(sum(w.ready for w in self.workers))
            await asyncio.sleep(POLL_S)

    async def refresh(self, worker: Worker) -> Status | None:
        """Ask ``worker`` for its status now; forget the calls that ended by themselves."""
        asked_at = asyncio.get_running_loop().time()
        was_ready = worker.ready
        status = await self.fetch_status(worker)
        if status is None:
            self._kill_if_hung(worker)
            return None
        worker.answered_at = asyncio.get_running_loop().time()
        worker.status = status
        live = set(status.sessions)
        for session_id, added in list(worker.sessions.items()):
            if session_id not in live and added < asked_at:
                del worker.sessions[session_id]
        for session_id in live:
            worker.sessions.setdefault(session_id, asked_at)
        if status.ready and not was_ready and worker.process is not None:
            rss = rss_mb(worker.process.pid)
            logger.info(
                "worker %d (pid %d) ready, %s MB resident",
                worker.index,
                worker.process.pid,
                "?" if rss is None else f"{rss:.0f}",
            )
        return status

    def _kill_if_hung(self, worker: Worker) -> None:
        process, answered = worker.process, worker.answered_at
        if process is None or process.returncode is not None or answered is None:
            return
        silent = asyncio.get_running_loop().time() - answered
        if silent < HUNG_AFTER_S or self.draining:
            return
        logger.error(
            "worker %d (pid %d) answered no status for %.0f s: killing it",
            worker.index,
            process.pid,
            silent,
        )
        self.metrics.hangs.inc()
        worker.answered_at = None  # once: its exit is handled (and it restarted) by _watch
        process.kill()

    async def fetch_status(self, worker: Worker) -> Status | None:
        data = await self.get_json(worker, STATUS_PATH)
        if data is None:
            return None
        try:
            return Status(
                int(data["pid"]),
                bool(data["ready"]),
                bool(data["draining"]),
                data["load_error"],
                [str(s) for s in data["sessions"]],
                float(data["cpu_cores"]),
                float(data["idle_cpu"]),
                float(data["speaking_call_cpu"]),
                float(data["cpu_limit"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    async def get_json(self, worker: Worker, path: str) -> Any:
        text = await self.get_text(worker, path)
        if text is None:
            return None
        import json

        try:
            return json.loads(text)
        except ValueError:
            return None

    async def get_text(self, worker: Worker, path: str) -> str | None:
        if worker.http is None or not worker.alive:
            return None
        try:
            async with worker.http.get(
                "http://worker" + path,
                headers={STATUS_SECRET: self.secret},
                timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    # -- choosing

    def worker_of(self, session_id: str) -> Worker | None:
        for worker in self.workers:
            if session_id in worker.sessions:
                return worker
        return None

    def least_loaded(self) -> Worker | None:
        """The ready worker with the fewest calls (the lowest index among equals)."""
        ready = self.ready_by_load()
        return ready[0] if ready else None

    def ready_by_load(self) -> list[Worker]:
        """The ready workers, fewest calls first (the lowest index among equals)."""
        ready = [w for w in self.workers if w.ready and not (w.status and w.status.draining)]
        return sorted(ready, key=lambda w: (w.load, w.index))

    def any_worker(self) -> Worker | None:
        """For the routes of no call (pages, /token, /ice-servers): ready ones in turn, else
        any whose HTTP server is up."""
        up = [w for w in self.workers if w.alive and w.status is not None]
        ready = [w for w in up if w.ready] or up
        if not ready:
            return None
        self._round_robin += 1
        return ready[self._round_robin % len(ready)]

    def total_load(self) -> int:
        return sum(w.load for w in self.workers)

    def worker_loads(self) -> list[WorkerLoad]:
        """The figures of the workers that answered a status, calls as the front counts them
        (its own count is ahead of their last status: a call it just forwarded counts)."""
        return [
            WorkerLoad(w.load, s.cpu_cores, s.idle_cpu, s.speaking_call_cpu, s.cpu_limit)
            for w in self.workers
            if (s := w.status) is not None and w.alive
        ]

    def machine_refusal(self) -> Refusal | None:
        """Whether the machine has no room for one more call (``headroom.machine_refusal``)."""
        return machine_refusal(self.worker_loads(), self.machine.busy_cores)

    # -- stopping

    def drain(self) -> None:
        """SIGTERM to every worker: each drains its calls as a single server does. A second
        call (a second signal) sends a second SIGTERM, which cuts their drains short."""
        self.draining = True
        for worker in self.workers:
            if worker.alive and worker.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)

    async def wait_exited(self) -> None:
        """Until every worker has exited; one still there long after its drain is killed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.server.drain_timeout_s + KILL_AFTER_DRAIN_S
        while any(w.alive for w in self.workers):
            if loop.time() > deadline:
                for worker in self.workers:
                    if worker.alive and worker.process is not None:
                        logger.error("worker %d did not drain in time: killed", worker.index)
                        with contextlib.suppress(ProcessLookupError):
                            worker.process.kill()
                deadline = loop.time() + KILL_AFTER_DRAIN_S
            await asyncio.sleep(0.1)
        if self.engines is not None:
            await self.engines.stop()  # after the workers: their calls rendered there
        if self.model is not None:
            await self.model.stop()  # likewise: their calls' replies came from it
        await asyncio.sleep(0.2)  # the relays print the workers' last lines

    async def close(self) -> None:
        self.draining = True
        for worker in self.workers:
            if worker.alive and worker.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
            if worker.http is not None:
                await worker.http.close()
                worker.http = None
        if self.engines is not None:
            await self.engines.stop()
        if self.model is not None:
            await self.model.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


async def _relay(index: int, stream: asyncio.StreamReader) -> None:
    """A worker's stderr (its log) onto the front's, each line marked with the worker."""
    prefix = f"worker {index}: ".encode()
    pending = b""
    out = sys.stderr
    while chunk := await stream.read(65536):
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        if len(pending) > 65536:
            lines.append(pending)
            pending = b""
        for line in lines:
            out.write((prefix + line + b"\n").decode(errors="replace"))
        out.flush()
    if pending:
        out.write((prefix + pending + b"\n").decode(errors="replace"))
        out.flush()
