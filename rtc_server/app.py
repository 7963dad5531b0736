"""The aiohttp application: routes, start-up loading, the session registry, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from aiortc import RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from musetalk_core.os_threads import namer
from musetalk_core.types import LipSyncEngine
from rtc_server.aiortc_compat import (
    negotiated_codec,
    restrict_host_addresses,
    send_at_media_time,
    send_encoded_audio,
    set_sender_encoder,
    stamp_sender_reports,
    use_fast_audio_level,
    use_fast_ntp_clock,
)
from rtc_server.config import ServerConfig
from rtc_server.cpu_priority import kernels_on_calling_thread
from rtc_server.embed import add_embed_route
from rtc_server.end_of_turn import EndOfTurnParams, load_end_of_turn
from rtc_server.engine_factory import EngineFactory, load_engine_factory
from rtc_server.headroom import Headroom, HeadroomSettings, MachineCpu
from rtc_server.ice import IceServers, announce_address
from rtc_server.internal_site import add_internal_routes
from rtc_server.local_llm.process import ModelProcess, ModelProcessError
from rtc_server.local_llm.provider import FIRST_WORDS as LOCAL_FIRST_WORDS
from rtc_server.local_llm.provider import LocalLLM
from rtc_server.media import libopus
from rtc_server.media.clock import VIDEO_RATE
from rtc_server.media.h264 import TunedH264Encoder
from rtc_server.media.inbound import low_latency_audio
from rtc_server.media.opus import ReplyOpusEncoder
from rtc_server.media.resilient_engine import ResilientEngine
from rtc_server.memory import (
    CollectorPauses,
    MemoryReleaser,
    freeze_startup_objects,
    limit_arenas,
)
from rtc_server.metrics import Metrics
from rtc_server.pages import STATIC_DIR
from rtc_server.providers.registry import Choice, Chosen, load_providers, refused_local_llm
from rtc_server.session import AvatarSession, ListenSettings, Providers
from rtc_server.synthesis_pool import DeadlinePool
from rtc_server.turns import DEFAULT_SYSTEM_PROMPT
from rtc_server.vad import SileroModel, VADParams
from signaling.access import access_middleware
from signaling.errors import MAX_BODY_BYTES, SignalingError, error_middleware
from signaling.headers import security_headers_middleware
from signaling.http import add_routes
from signaling.messages import Answer, Offer, SayRequest

if TYPE_CHECKING:
    from openai import AsyncOpenAI

logger = logging.getLogger(__name__)

RTP_CLOCK_RATES = {"audio/opus": 48_000, "video/H264": 90_000, "video/VP8": 90_000}
"""RTP clock rates of the codecs a call sends, for its sender reports."""


class SessionManager:
    """Creates, finds and tears down calls; implements signaling's SessionFactory."""

    def __init__(
        self,
        config: ServerConfig,
        metrics: Metrics,
        executor: Executor,
        *,
        freeze_when_loaded: bool = False,
    ) -> None:
        self.config = config
        self.freeze_when_loaded = freeze_when_loaded
        """Move what loading made out of the collector's reach (rtc_server/memory.py): for the
        process's one server, not for one of many in a process (the tests')."""
        self.metrics = metrics
        self.executor = executor
        self.sessions: dict[str, AvatarSession] = {}
        self.engine_factory: EngineFactory | None = None
        self.providers: Providers | None = None
        self.openai: AsyncOpenAI | None = None
        """The SDK client the OpenAI providers share; closed at shutdown."""
        self.choices: tuple[Choice, ...] = ()
        self.model_process: ModelProcess | None = None
        """The local model's process, when this server runs one (rtc_server/local_llm)."""
        self.settings = ListenSettings(
            vad=VADParams(hangover_ms=config.conversation.vad_hangover_ms),
            system_prompt=config.conversation.system_prompt or DEFAULT_SYSTEM_PROMPT,
            barge_in=config.conversation.barge_in,
            max_text_chars=config.server.max_say_chars,
            end_of_turn=EndOfTurnParams(
                complete_hangover_ms=config.conversation.complete_hangover_ms,
                incomplete_hangover_ms=config.conversation.incomplete_hangover_ms,
            ),
            speculate=config.conversation.speculate,
        )
        self.ice = IceServers.from_config(
            config.media.ice_servers,
            turn_urls=config.media.turn_urls,
            turn_secret=config.media.turn_secret,
            turn_ttl_s=config.media.turn_ttl_s,
        )
        self.draining = False
        """Set on SIGTERM: no new calls, running ones go on until the drain timeout."""
        self.headroom = Headroom(
            HeadroomSettings(cpu_limit=config.server.cpu_limit or Headroom.default_cpu_limit()),
            MachineCpu(),
        )
        """What this process measures of its own load and the machine's; refuses calls it has
        no room for (a worker's judges its own calls only: workers/child.py)."""
        self._ended_speech = (0, 0, 0)
        """Speech instants presented and held by calls that have ended."""
        self._pending = 0
        # Every call's every audio frame counts in one of these (50 a second a call).
        self._frames_replayed = metrics.audio_frames.labels("replayed")
        self._frames_encoded = metrics.audio_frames.labels("encoded")
        self.memory = MemoryReleaser(executor, lambda: not self.sessions and not self._pending)
        """Gives the heap of ended calls back to the OS (rtc_server/memory.py)."""
        self.load_error: Exception | None = None
        """Why loading the models failed (the server then refuses calls: ``load_failed``)."""

    @property
    def ready(self) -> bool:
        return self.engine_factory is not None and self.providers is not None

    async def load(
        self, engine_loader: Callable[[], EngineFactory], http: aiohttp.ClientSession
    ) -> None:
        try:
            await self._load(engine_loader, http)
        except Exception as exc:
            self.load_error = exc
            raise

    async def _load(
        self, engine_loader: Callable[[], EngineFactory], http: aiohttp.ClientSession
    ) -> None:
        loop = asyncio.get_running_loop()
        # Every call's audio goes through libopus: without it the server is not ready (and
        # /readyz says why), rather than refusing each offer as it comes.
        await loop.run_in_executor(self.executor, libopus.library)
        chosen = await loop.run_in_executor(
            self.executor, load_providers, self.config, http, self.executor
        )
        self.openai = chosen.openai
        if chosen.model is not None:
            chosen = await self._start_model(chosen)
        vad = await loop.run_in_executor(self.executor, SileroModel.shared)
        end_of_turn = await loop.run_in_executor(
            self.executor, load_end_of_turn, self.config.conversation.end_of_turn
        )
        factory = await loop.run_in_executor(self.executor, engine_loader)
        if factory.start is not None:
            await factory.start()
        self.engine_factory = factory
        self.choices = chosen.choices
        if isinstance(chosen.llm, LocalLLM):
            self.settings = dataclasses.replace(self.settings, first_words=LOCAL_FIRST_WORDS)
        self.providers = Providers(
            tts=chosen.tts,
            llm=chosen.llm,
            stt=chosen.stt,
            vad=vad,
            fallback_tts=chosen.local_tts,
            realtime=chosen.realtime,
            end_of_turn=end_of_turn,
        )
        if self.freeze_when_loaded:
            # Before ready: the collection inside takes ~100 ms, which no call must wait for.
            self.metrics.gc_frozen.set(freeze_startup_objects())
        logger.info("ready: engine %s", self.engine_factory.name)

    async def _start_model(self, chosen: Chosen) -> Chosen:
        """Start the local model's process; ``echo`` answers if it cannot start."""
        assert chosen.model is not None
        process = ModelProcess(
            chosen.model,
            warm_prompt=self.settings.system_prompt,
            on_restart=self.metrics.model_restarts.inc,
        )
        try:
            await process.start()
        except (ModelProcessError, OSError) as exc:
            from rtc_server.providers.echo_llm import EchoLLM

            await process.stop()
            if isinstance(chosen.llm, LocalLLM):
                await chosen.llm.aclose()
            logger.error("the local model did not start, answering with echo: %s", exc)
            llm = next(c for c in chosen.choices if c.slot == "llm")
            choices = tuple(
                refused_local_llm(c, str(exc)) if c is llm else c for c in chosen.choices
            )
            return dataclasses.replace(chosen, llm=EchoLLM(), choices=choices, model=None)
        self.model_process = process
        self.headroom.helper_cpu = process.cpu_seconds  # its CPU is the calls' too
        return chosen

    async def close_models(self) -> None:
        """What loading opened beside the calls: the local model's process and its client."""
        if self.model_process is not None:
            await self.model_process.stop()
        if self.providers is not None and isinstance(self.providers.llm, LocalLLM):
            await self.providers.llm.aclose()
        if self.openai is not None:
            await self.openai.close()

    async def create_session(self, offer: Offer) -> Answer:
        if self.load_error is not None:  # not a wait: the server cannot take calls at all
            raise SignalingError(503, "load_failed", f"model loading failed: {self.load_error}")
        if self.engine_factory is None or self.providers is None:
            raise SignalingError(
                503, "not_ready", "models are still loading", headers={"Retry-After": "2"}
            )
        if self.draining:
            raise SignalingError(
                503,
                "draining",
                "the server is shutting down and takes no new calls; try again",
                headers={"Retry-After": "2"},
            )
        if offer.avatar is not None:
            raise SignalingError(
                400, "unknown_avatar", "this server has one avatar; leave 'avatar' out"
            )
        if len(self.sessions) + self._pending >= self.config.server.max_sessions:
            raise SignalingError(
                503,
                "at_capacity",
                f"the server is at its limit of {self.config.server.max_sessions} calls",
                headers={"Retry-After": "5"},
            )
        self.headroom.calls = len(self.sessions) + self._pending
        # Engines that hold frames predict a new call's only where the calls share the
        # engine (MuseTalk batches every call on one GPU); a CPU engine is one per call.
        shared = self.engine_factory.name == "musetalk"
        refusal = (
            self.headroom.refusal(engine_shared=shared) if self.config.server.headroom else None
        )
        if refusal is not None:
            self.metrics.calls_refused.labels("headroom").inc()
            logger.warning("call refused: %s", refusal.reason)
            raise SignalingError(
                503,
                "at_capacity",
                f"the server has no room for another call now: {refusal.reason}",
                headers={"Retry-After": str(refusal.retry_after_s)},
            )
        self._pending += 1
        try:
            engine = ResilientEngine(
                self.engine_factory.create(), fallback=self.engine_factory.fallback
            )
            return await self._answer(offer, engine)
        finally:
            self._pending -= 1

    async def _answer(self, offer: Offer, engine: LipSyncEngine) -> Answer:
        pc = RTCPeerConnection(self.ice.rtc_configuration())
        assert self.providers is not None and self.engine_factory is not None
        session = AvatarSession(
            pc,
            engine,
            self.providers,
            settings=self.settings,
            metrics=self.metrics,
            executor=self.executor,
            on_closed=self._forget,
            connect_timeout_s=self.config.server.connect_timeout_s,
            messages=self.config.access.message_limiter(),
            max_call_s=self.config.server.max_call_s,
            idle_timeout_s=self.config.server.idle_timeout_s or None,
            visemes=offer.visemes,
            resume_grace_s=self.config.server.resume_grace_s,
            # The sync-test engine stands in for a speaking avatar: a deployment check must
            # see the stream a talking face sends, every frame.
            still_repeat_s=(
                0.0 if self.engine_factory.name == "sync-test" else self.config.media.still_repeat_s
            ),
            audio_start_s=self.config.media.audio_start_s,
            video_lead_s=self.config.media.video_lead_s,
        )
        if self.engine_factory.notice:
            session.notices.append(("engine_fallback", self.engine_factory.notice))
        try:
            negotiated = await self._wire(pc, session, offer)
        except Exception:
            await session.aclose()
            raise
        self.sessions[session.id] = session
        self.headroom.calls = len(self.sessions)
        self.metrics.sessions.set(len(self.sessions))
        self.metrics.calls_answered.inc()
        session.start()
        logger.info("session %s answered (%s)", session.id[:8], negotiated)
        return self._answer_of(pc, session)

    def _answer_of(self, pc: RTCPeerConnection, session: AvatarSession) -> Answer:
        sdp = announce_address(pc.localDescription.sdp, self.config.media.public_address)
        return Answer(sdp=sdp, session_id=session.id, resume=session.resume_credential)

    async def _wire(self, pc: RTCPeerConnection, session: AvatarSession, offer: Offer) -> str:
        """Answer ``offer`` on ``pc`` with ``session``'s tracks; returns the video codec.
        SignalingError 400 bad_sdp for an offer that cannot be answered."""
        try:
            # The video transceiver must exist before the offer is applied, or aiortc keeps the
            # browser's codec order (VP8 first): prefer H.264, VP8 only when H.264 is missing.
            video = pc.addTransceiver(session.video_track, direction="sendonly")
            # Frames taken ahead of their instants are encoded meanwhile and sent at them
            # (or ``video_send_delay_s`` after them).
            late = self.config.media.video_send_delay_s
            send_at_media_time(video.sender, VIDEO_RATE, session.clock.sleep_until, late)
            codecs = RTCRtpSender.getCapabilities("video").codecs
            wanted = "video/H264" if "video/H264" in offer.video_codecs else "video/VP8"
            video.setCodecPreferences(
                [c for c in codecs if c.mimeType == wanted]
                + [c for c in codecs if c.mimeType == "video/rtx"]
            )
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer.sdp, type="offer"))
            pc.addTrack(session.audio_track)
            for transceiver in pc.getTransceivers():
                if transceiver.kind == "audio":
                    low_latency_audio(transceiver, session.mic_rate)
                if (
                    transceiver.sender.track is session.audio_track
                    and negotiated_codec(transceiver) == "audio/opus"
                ):
                    session.audio_track.encode_with(ReplyOpusEncoder(on_frame=self._audio_sent))
                    send_encoded_audio(
                        transceiver.sender,
                        session.audio_track.recv_encoded,
                        on_rtp_origin=session.visemes.set_rtp_origin,
                    )
                rate = RTP_CLOCK_RATES.get(negotiated_codec(transceiver) or "")
                if self.config.media.sender_reports == "media" and rate is not None:
                    # Both tracks' reports from the call's clock: in step on the receiver.
                    stamp_sender_reports(
                        transceiver.sender,
                        rate,
                        session.wall_time_of,
                        on_frame_out=self._frame_delay(session, transceiver.kind),
                    )
            negotiated = negotiated_codec(video)
            if negotiated == "video/H264":
                set_sender_encoder(
                    video.sender,
                    TunedH264Encoder(on_encode=self.metrics.encode_seconds.observe),
                )
            await pc.setLocalDescription(await pc.createAnswer())
        except SignalingError:
            raise
        except Exception as exc:
            raise SignalingError(400, "bad_sdp", f"the offer could not be answered: {exc}") from exc
        return negotiated or "none"

    async def resume_session(self, session_id: str, credential: str, offer: Offer) -> Answer:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise SignalingError(
                404, "unknown_session", f"no session {session_id!r} (it ended, or never was)"
            )
        if not session.may_resume(credential):
            raise SignalingError(401, "bad_resume", "that is not this call's resume credential")
        # One resume at a time: two racing would leave a peer connection behind.
        async with session.resuming:
            if session.closed:
                raise SignalingError(404, "unknown_session", f"no session {session_id!r}")
            await session.leave_peer()
            pc = RTCPeerConnection(self.ice.rtc_configuration())
            try:
                negotiated = await self._wire(pc, session, offer)
            except Exception:
                await pc.close()
                raise  # the call waits on for a resume that works, until its grace runs out
            session.attach(pc)
        self.metrics.calls_resumed.inc()
        logger.info("session %s resumed (%s)", session.id[:8], negotiated)
        return self._answer_of(pc, session)

    async def _forget(self, session: AvatarSession) -> None:
        if self.sessions.pop(session.id, None) is not None:
            stats = session.scheduler.stats
            spoken, held, units = self._ended_speech
            self._ended_speech = (
                spoken + stats.speaking_units,
                held + stats.held_units,
                units + stats.units,
            )
            self.headroom.calls = len(self.sessions)
            self.metrics.sessions.set(len(self.sessions))
            self.memory.release_soon()

    def _frame_delay(self, session: AvatarSession, kind: str) -> Callable[[float], None]:
        """What observes how late each of ``session``'s ``kind`` frames leaves: after its
        instant, or for video after ``video_send_delay_s`` past it, when it was due."""
        histogram = self.metrics.frame_delay.labels(kind)
        clock = session.clock
        due_after = self.config.media.video_send_delay_s if kind == "video" else 0.0

        def observe(media_s: float) -> None:
            histogram.observe(max(0.0, clock.now() - media_s - due_after))

        return observe

    def _audio_sent(self, replayed: bool) -> None:
        (self._frames_replayed if replayed else self._frames_encoded).inc()

    def speech_totals(self) -> tuple[int, int, int]:
        """(speech instants presented, instants held, all instants presented) since start,
        over every call."""
        stats = [s.scheduler.stats for s in self.sessions.values()]
        spoken, held, units = self._ended_speech
        return (
            spoken + sum(x.speaking_units for x in stats),
            held + sum(x.held_units for x in stats),
            units + sum(x.units for x in stats),
        )

    def load_report(self) -> dict[str, float | int | None]:
        """What ``/readyz`` reports of this process's load."""
        return {"sessions": len(self.sessions), **self.headroom.snapshot()}

    def say(self, session_id: str, request: SayRequest) -> str:
        return self.sessions[session_id].say(request.text, interrupt=request.interrupt)

    async def close_session(self, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        if session is None:
            return False
        await session.aclose()
        return True

    def exists(self, session_id: str) -> bool:
        return session_id in self.sessions

    async def drain(self, timeout_s: float, cut_short: asyncio.Event | None = None) -> None:
        """Take no new calls; let running ones go on up to ``timeout_s``, then end them.

        ``cut_short`` (a second SIGTERM) ends the wait early.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        logger.info("draining: %d calls, up to %.0f s", len(self.sessions), timeout_s)
        while self.sessions or self._pending:
            left = deadline - loop.time()
            if left <= 0 or (cut_short is not None and cut_short.is_set()):
                break
            await asyncio.sleep(min(0.1, left))
        if self.sessions:
            logger.info("drain over: ending %d calls", len(self.sessions))
            await asyncio.gather(
                *(
                    s.end("shutting_down", "the server is shutting down")
                    for s in list(self.sessions.values())
                )
            )

    async def close_all(self) -> None:
        await asyncio.gather(*(s.aclose() for s in list(self.sessions.values())))
        self.memory.cancel()


MANAGER = web.AppKey("manager", SessionManager)
METRICS = web.AppKey("metrics", Metrics)


def create_app(
    config: ServerConfig,
    *,
    engine_loader: Callable[[], EngineFactory] | None = None,
    behind_front: bool = False,
    owns_process: bool = False,
) -> web.Application:
    """Build the application; models load in the background and /readyz says when they are in.

    ``behind_front``: a worker of ``--workers``, which only the front reaches; the front has
    told the client, scheme and host apart and refused unknown hosts.
    ``owns_process``: the only server of its process (``serve``, a worker), which may then
    freeze what it loaded for the garbage collector (rtc_server/memory.py)."""
    use_fast_audio_level()
    use_fast_ntp_clock()
    restrict_host_addresses(config.media.ice_addresses)
    limit_arenas()
    kernels_on_calling_thread()
    access = config.access.build_policy()
    app = web.Application(
        middlewares=[
            security_headers_middleware(access),
            error_middleware,
            *([] if behind_front else [config.access.client_view(config.server.host).middleware()]),
            access_middleware(access),
        ],
        client_max_size=MAX_BODY_BYTES,
    )
    metrics = Metrics()
    # Reply speech (synthesis, its resampling and mouth timing) and the model loads, the most
    # pressing first (a playing reply's next piece before replies yet to begin).
    executor = DeadlinePool(2, thread_name_prefix="avatar-rtc", initializer=namer("reply-speech"))
    manager = SessionManager(config, metrics, executor, freeze_when_loaded=owns_process)
    app[METRICS] = metrics
    app[MANAGER] = manager
    loader = engine_loader or (lambda: load_engine_factory(config))
    collections_timed = CollectorPauses()
    """The garbage collector's pauses, recorded into the metrics at each scrape."""

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # One connection pool for every cloud provider request of every call.
        http = aiohttp.ClientSession()
        loading = asyncio.ensure_future(manager.load(loader, http))
        app[LOADING] = loading
        manager.headroom.start(manager.speech_totals)
        with collections_timed:
            yield
        await manager.headroom.aclose()
        loading.cancel()
        try:
            await loading
        except (asyncio.CancelledError, Exception):
            pass
        await manager.close_all()
        if manager.engine_factory is not None and manager.engine_factory.close is not None:
            manager.engine_factory.close()
        await manager.close_models()
        await http.close()
        executor.shutdown(wait=True, cancel_futures=True)

    app.cleanup_ctx.append(lifecycle)
    add_routes(
        app,
        manager,
        access,
        max_say_chars=config.server.max_say_chars,
        peers=config.media.peer_rule(config.server.host),
    )
    add_embed_route(app, access)

    async def index(request: web.Request) -> web.FileResponse:
        # Its CSP and frame-ancestors, as every response's: signaling.headers.
        return web.FileResponse(STATIC_DIR / "index.html")

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        loading = app[LOADING]
        if loading.done() and not loading.cancelled() and loading.exception() is not None:
            raise SignalingError(503, "load_failed", f"model loading failed: {loading.exception()}")
        if manager.draining:
            raise SignalingError(503, "draining", "the server is shutting down")
        if not manager.ready:
            raise SignalingError(503, "not_ready", "models are still loading")
        return web.json_response({"status": "ready", **manager.load_report()})

    async def ice_servers(request: web.Request) -> web.Response:
        # What a browser needs before it creates its RTCPeerConnection: as guarded as /offer.
        access.require_token(request)
        return web.json_response(
            {"iceServers": manager.ice.for_browser(), "ttl_s": manager.ice.ttl_s},
            headers={"Cache-Control": "no-store"},
        )

    async def metrics_route(request: web.Request) -> web.Response:
        metrics.observe_load(manager.headroom)
        collections_timed.drain(metrics.observe_gc_pause)
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/ice-servers", ice_servers)
    add_internal_routes(app, config, readyz=readyz, metrics=metrics_route)
    app.router.add_static("/static/", STATIC_DIR)
    return app


LOADING = web.AppKey("loading", asyncio.Task)
