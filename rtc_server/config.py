"""Server configuration: one frozen object in five sections, each validated once.

:class:`ServerConfig` holds a :class:`ServerSettings` (``config.server``: the HTTP server and
its limits), :class:`AccessSettings` (``access``: who may call), :class:`MediaSettings`
(``media``: how media reaches the caller), :class:`EngineSettings` (``engine``: the avatar and
its lip-sync engine) and :class:`ConversationSettings` (``conversation``: speech in and out).
The sections are the option groups of ``avatar-rtc serve`` (``rtc_server/options.py``).
Every field name is unique across the sections, so :meth:`ServerConfig.of` and
:meth:`ServerConfig.replace` take fields by their plain names.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from musetalk_core.framing import FRAMINGS
from musetalk_core.types import AvatarRtcError
from signaling.access import ORIGIN, AccessPolicy, TokenSigner
from signaling.addresses import parse_ip, parse_networks
from signaling.forwarded import ClientView
from signaling.offer_rules import PeerRule
from signaling.quota import DEFAULT_CALLS_PER_CLIENT, DEFAULT_CALLS_PER_TOKEN, CallQuota
from signaling.ratelimit import RateLimiter

ENGINES = ("auto", "musetalk", "warp", "sync-test")
STTS = ("auto", "local", "openai")
LLMS = ("auto", "local", "echo", "openai")
TTSS = ("auto", "piper", "elevenlabs", "openai")
CONVERSATIONS = ("pipeline", "openai-realtime")
REALTIME_TURNS = ("ours", "service")
END_OF_TURNS = ("auto", "smart-turn", "off")


class ConfigError(AvatarRtcError, ValueError):
    """A configuration the server cannot run with; the message names the option."""


def _is_loopback(host: str) -> bool:
    ip = parse_ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "avatar-rtc"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    max_sessions: int = 8
    headroom: bool = True
    """Refuse a new call (503 at_capacity) when this process has no headroom left for it:
    event-loop lag, CPU plus the measured cost of a call, engines not keeping up."""
    cpu_limit: float | None = None
    """Cores this process may use for calls; None: 90 % of its share of the machine."""
    connect_timeout_s: float = 10.0
    """A call whose peer has not connected (ICE and DTLS) this long after its answer is closed,
    and its slot freed."""
    cache_dir: Path = field(default_factory=default_cache_dir)
    cert_file: Path | None = None
    key_file: Path | None = None
    idle_timeout_s: float = 300.0
    """A call with no caller speech, typed text or say for this long is closed (0: never)."""
    max_say_chars: int = 2000
    """Longest text of a say or a typed turn, over HTTP or the data channel."""
    metrics_port: int = 0
    """Serve /metrics and /readyz's details on this port of ``metrics_host``, not on the main
    one (0: on the main one, public to whoever reaches it)."""
    metrics_host: str = "127.0.0.1"
    log_format: str = "text"
    """"text", or "json": one JSON object a line (rtc_server/logs.py)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long running calls may go on before they are closed."""
    max_call_s: float = 3600.0
    """A call is closed after this long."""
    resume_grace_s: float = 20.0
    """A call whose link failed (ICE failed, or nothing heard from the caller for
    ``PEER_SILENCE_S``) waits this long after the caller was last heard for a new peer
    connection to resume it (``POST /sessions/{id}/resume``), then is freed (0: at once)."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be 1..65535, not {self.port}")
        if self.max_call_s <= 0:
            raise ConfigError("max_call_s must be > 0")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("--cert-file and --key-file go together")
        if self.connect_timeout_s <= 0:
            raise ConfigError("connect_timeout_s must be > 0")
        if self.resume_grace_s < 0:
            raise ConfigError("resume_grace_s must be >= 0")
        if self.idle_timeout_s < 0 or self.drain_timeout_s < 0:
            raise ConfigError("idle_timeout_s and drain_timeout_s must be >= 0")
        if self.max_say_chars < 1:
            raise ConfigError("max_say_chars must be at least 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535, not {self.metrics_port}")
        if self.metrics_port and self.metrics_port == self.port:
            raise ConfigError("--metrics-port must differ from --port (0: on the main port)")


MIN_KEY_CHARS = 32
PLACEHOLDERS = (
    "replace-me",
    "replace_me",
    "replaceme",
    "changeme",
    "change-me",
    "change_me",
    "placeholder",
    "example",
    "your-key",
    "your_key",
    "xxxxxxxx",
)
"""Words of the values that examples and templates ship: such a key is public knowledge."""


def check_key(what: str, value: str | None) -> None:
    """ConfigError for a key anyone could guess: short, of few characters, or a placeholder."""
    if value is None:
        return
    how = "generate one with `openssl rand -hex 32`"
    lowered = value.lower()
    if any(word in lowered for word in PLACEHOLDERS) or lowered in ("secret", "password"):
        raise ConfigError(f"{what} is a placeholder from an example: {how}")
    if len(value) < MIN_KEY_CHARS:
        raise ConfigError(f"{what} is {len(value)} characters, under {MIN_KEY_CHARS}: {how}")
    if len(set(value)) < 8:
        raise ConfigError(f"{what} repeats a few characters ({len(set(value))} distinct): {how}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessSettings:
    allowed_origins: tuple[str, ...] = ()
    """Browser origins besides the server's own that may call the API ("*": any)."""
    api_key: str | None = field(default=None, repr=False)
    """Turns token auth on: /offer then needs a token minted by POST /token."""
    private_network: bool = False
    """Only a private network reaches the server: TURN credentials may go out without
    an API key (on a public one, /ice-servers would hand a relay to anyone)."""
    rate_limit_per_min: int = 60
    """/offer and /token requests per client address and minute, in bursts of up to a third
    of that (0: no limit)."""
    max_calls_per_client: int = DEFAULT_CALLS_PER_CLIENT
    """Live calls one client address (an IPv6 client: its /64) may hold (0: no limit)."""
    max_calls_per_token: int = DEFAULT_CALLS_PER_TOKEN
    """Live calls one token may open, with auth on (0: no limit)."""
    trusted_proxies: tuple[str, ...] = ()
    """Addresses or CIDRs of proxies whose X-Forwarded-For/-Proto/-Host are believed."""
    public_origin: str | None = None
    """The origin callers reach the server at (https://avatar.example.com): the server's own
    origin for the origin checks, and the one host name it answers for."""
    call_messages_per_min: int = 60
    """Says and data-channel messages per call and minute, in bursts of up to a third of that
    (429 rate_limited over HTTP, an error event on the channel; 0: no limit)."""

    def __post_init__(self) -> None:
        check_key("the API key (--api-key-file, AVATAR_RTC_API_KEY)", self.api_key)
        for name in (
            "rate_limit_per_min",
            "max_calls_per_client",
            "max_calls_per_token",
            "call_messages_per_min",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        try:
            parse_networks(self.trusted_proxies)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.public_origin is not None and not ORIGIN.fullmatch(self.public_origin):
            raise ConfigError(
                "--public-origin must be scheme://host[:port] (no path), "
                f"not {self.public_origin!r}"
            )
        for origin in self.allowed_origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ConfigError(
                    f"--allowed-origin must be scheme://host[:port] (no path), not {origin!r}"
                )

    def build_policy(self) -> AccessPolicy:
        """A new policy of these settings (its rate limiter starts empty)."""
        per_min = self.rate_limit_per_min
        limiter = RateLimiter(per_min / 60, burst=max(1, per_min // 3)) if per_min else None
        signer = TokenSigner(self.api_key) if self.api_key else None
        quota = None
        if self.max_calls_per_client or self.max_calls_per_token:
            quota = CallQuota(self.max_calls_per_client, self.max_calls_per_token)
        return AccessPolicy(
            frozenset(self.allowed_origins), signer, limiter, quota, self.public_origin
        )

    def client_view(self, listen_host: str) -> ClientView:
        """Client address, scheme and host behind the trusted proxies, for a server listening
        on ``listen_host``."""
        return ClientView(
            parse_networks(self.trusted_proxies),
            public_origin=self.public_origin,
            loopback_only=_is_loopback(listen_host),
        )

    def message_limiter(self) -> RateLimiter | None:
        """A new per-call limiter of says and data-channel messages (None: no limit)."""
        per_min = self.call_messages_per_min
        return (
            RateLimiter(per_min / 60, burst=max(1, per_min // 3), max_clients=1)
            if per_min
            else None
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaSettings:
    ice_addresses: tuple[str, ...] = ()
    """Host addresses ICE may gather; empty means every interface."""
    ice_servers: tuple[str, ...] = ()
    """STUN/TURN URLs (turn:user:password@host:port); none by default, nothing leaves the host."""
    turn_secret: str | None = field(default=None, repr=False)
    """coturn's static-auth-secret: time-limited TURN credentials are minted from it."""
    turn_urls: tuple[str, ...] = ()
    """TURN URLs the minted credentials are for (turn:host:3478?transport=udp)."""
    turn_ttl_s: int = 3600
    """How long minted TURN credentials stay valid."""
    public_address: str | None = None
    """NAT 1:1: the address announced in host candidates instead of the gathered one."""
    peer_networks: tuple[str, ...] = ()
    """Networks (CIDR) besides public addresses whose candidates in an offer are checked;
    a server listening on loopback only takes every unicast address."""
    still_repeat_s: float = 0.25
    """While the avatar is idle and its picture does not change, a video frame goes out only
    this often (0: every frame, 25 fps always)."""
    sender_reports: str = "media"
    """What the RTCP sender reports map RTP time to: "media", the call's clock (both tracks in
    step however late either packet went out); "sent", aiortc's own, the time each last packet
    left (kept for measuring the difference: ``bench sync --browser --fresh-calls``)."""
    audio_start_s: float = 0.6
    """A peer connection's audio starts this long after it was first asked for, its video at
    once (0: together; no speech is placed before the audio starts). A browser plays a call's
    audio only once the first video frame is shown, and audio that arrived before waits in its
    jitter buffer, which drains by ~10 ms a second: sent from the start, the first seconds of
    fresh Chromium calls played late against the picture (benchmarks/README.md, 2026-12-03; the
    default since 2026-12-04)."""
    video_lead_s: float = 0.02
    """A video frame is taken and encoded this long before its instant and sent at it (0: taken
    at its instant, sent when encoded). The encode and its thread hand-offs then no longer
    delay the frame: on a busy server they made frames leave 5-15 ms late, unevenly. Speech
    starts this much later so that its first frame is ready as early (at most one frame)."""
    video_send_delay_s: float = 0.025
    """A video frame leaves this long after its instant (0: at it); its RTP time and the sender
    reports stay on the call's clock, so a receiver that lines the streams up by the reports is
    not moved, and the audio is not delayed. Chromium plays a fresh call's audio about 30 ms
    behind its video until its lip-sync settles, 15-20 s in; with 0.025 the first seconds play
    at the settled offset (benchmarks/README.md, 2026-12-04 midnight; the default since
    2026-12-05). A receiver that times the streams by arrival alone (aiortc's, or our own
    measurements on an aiortc caller) sees the video this much later, and takes it off
    (``benchmarks.analysis.frame_times``)."""

    def __post_init__(self) -> None:
        if bool(self.turn_secret) != bool(self.turn_urls):
            raise ConfigError(
                "a TURN secret (AVATAR_RTC_TURN_SECRET, --turn-secret-file) and --turn-url "
                "go together"
            )
        check_key("the TURN secret (--turn-secret-file, AVATAR_RTC_TURN_SECRET)", self.turn_secret)
        for url in self.turn_urls:
            if not url.startswith(("turn:", "turns:")) or "@" in url:
                raise ConfigError(f"--turn-url must be turn:host:port or turns:..., not {url!r}")
        if self.sender_reports not in ("media", "sent"):
            raise ConfigError(f"sender_reports must be media or sent, not {self.sender_reports!r}")
        if not 0.0 <= self.video_lead_s <= 0.04:
            raise ConfigError(f"video_lead_s must be 0 .. 0.04 s, not {self.video_lead_s}")
        if not 0.0 <= self.video_send_delay_s <= 0.1:
            raise ConfigError(
                f"video_send_delay_s must be 0 .. 0.1 s, not {self.video_send_delay_s}"
            )
        if not 0.0 <= self.audio_start_s <= 2.0:
            raise ConfigError(f"audio_start_s must be 0 .. 2 s, not {self.audio_start_s}")
        if not 60 <= self.turn_ttl_s <= 7 * 86400:
            raise ConfigError("turn_ttl_s must be 60 s .. 7 days")
        if self.public_address is not None:
            try:
                public = ipaddress.ip_address(self.public_address)
            except ValueError:
                raise ConfigError(
                    f"--public-address must be an IP address, not {self.public_address!r}"
                ) from None
            if public.is_unspecified:
                raise ConfigError("--public-address cannot be the unspecified address")
        try:
            parse_networks(self.peer_networks, "--peer-network")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def peer_rule(self, listen_host: str) -> PeerRule:
        """Which offered candidates a server listening on ``listen_host`` may check."""
        networks = parse_networks(self.peer_networks, "--peer-network")
        return PeerRule(networks, local=_is_loopback(listen_host))


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    name: str = "auto"
    """The lip-sync engine (--engine): one of ENGINES."""
    avatar: Path | None = None
    """Portrait image or video; None for the built-in avatar."""
    framing: str = "head"
    """What of the avatar's picture the caller sees (--framing): ``head`` and shoulders,
    512x512, or the ``full`` picture (musetalk_core/framing.py)."""
    weights_dir: Path | None = None
    """MuseTalk weights (layout in musetalk_core.weights); None: the default cache folder."""
    musetalk_device: str = "auto"
    """auto (CUDA when present), cuda, cuda:N or cpu."""
    musetalk_batch: int = 16
    """Largest MuseTalk batch, shared by all calls."""
    musetalk_compile: bool = False
    """torch.compile the UNet and VAE decoder (slow start, faster steady state on CUDA)."""
    musetalk_engine_socket: Path | None = None
    """Set by the front for its media workers: the socket of the MuseTalk engine process
    their calls render in, batched with every other worker's (rtc_server/workers/engines.py)."""

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, not {self.name!r}")
        if self.framing not in FRAMINGS:
            raise ConfigError(f"framing must be one of {', '.join(FRAMINGS)}")
        if not 1 <= self.musetalk_batch <= 256:
            raise ConfigError("--musetalk-batch must be 1..256")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationSettings:
    mode: str = "pipeline"
    """``pipeline``: STT, LLM and TTS; ``openai-realtime``: one speech-to-speech model hears and
    answers (the TTS still speaks says and the apology is the local voice's)."""
    realtime_model: str = "gpt-realtime"
    realtime_voice: str = "marin"
    realtime_transcription_model: str = "gpt-4o-mini-transcribe"
    """Transcribes the caller for ``transcript`` events and the history ("" for none)."""
    realtime_turns: str = "ours"
    """Who ends the caller's turn: our VAD (``ours``) or the service's (``service``)."""
    realtime_session_s: float = 3000.0
    """Age at which a call's Realtime connection is renewed, between turns, with the
    conversation carried over (the service ends sessions at 60 minutes)."""
    stt: str = "auto"
    llm: str = "auto"
    """``auto``: OpenAI (or the endpoint at ``openai_base_url``) with a key or base URL, else
    the local model (rtc_server/local_llm), else ``echo``."""
    local_model_socket: Path | None = None
    """Set by the front for its media workers: the socket of the machine's one local model
    process, which the front runs (rtc_server/local_llm/process.py)."""
    tts: str = "auto"
    openai_api_key: str | None = field(default=None, repr=False)
    openai_base_url: str | None = None
    """OpenAI or any OpenAI-compatible endpoint (vLLM, Ollama, llama.cpp), up to /v1."""
    elevenlabs_api_key: str | None = field(default=None, repr=False)
    elevenlabs_base_url: str | None = None
    llm_model: str = "gpt-4o-mini"
    max_tokens: int = 150
    """Reply cap: every word costs video frames and the caller's patience."""
    system_prompt: str | None = None
    """None: the built-in short-answer prompt."""
    openai_tts_voice: str = "alloy"
    elevenlabs_voice: str | None = None
    piper_deterministic: bool = False
    """The local voice without its sampled variation: the same text always gives the same
    audio (tests and benchmarks compare a reply with the same sentence alone)."""
    provider_attempts: int = 3
    """Tries per cloud request when the error is retryable (429, 5xx, timeouts)."""
    provider_backoff_s: float = 0.25
    """First wait between tries; it doubles each time."""
    provider_read_timeout_s: float = 15.0
    """Longest silence of a cloud provider mid-answer (or before its first byte) before the
    request fails: a reply whose LLM or TTS stalls gets an error and the spoken apology."""
    vad_hangover_ms: int = 500
    """Silence after speech that ends the caller's turn (when no end-of-turn model judges it)."""
    end_of_turn: str = "auto"
    """``smart-turn``: a model judges at each pause whether the caller has finished, and the
    turn ends after ``complete_hangover_ms`` or ``incomplete_hangover_ms`` of silence; ``off``:
    after ``vad_hangover_ms``; ``auto``: the model when it is installed
    (rtc_server/end_of_turn.py)."""
    complete_hangover_ms: int = 300
    """Silence that ends a turn the end-of-turn model judges finished: longer than a pause at
    a comma after a finished clause (docs/DECISIONS.md, "A semantic end of turn")."""
    incomplete_hangover_ms: int = 1200
    """Silence that ends a turn the end-of-turn model judges unfinished."""
    speculate: bool = True
    """Start the reply at a pause, before the turn has ended (rtc_server/speculation.py)."""
    barge_in: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("stt", STTS), ("llm", LLMS), ("tts", TTSS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if name_missing := [
            n
            for n, need, key in (
                ("stt", "openai", self.openai_api_key),
                ("tts", "openai", self.openai_api_key),
                ("tts", "elevenlabs", self.elevenlabs_api_key),
            )
            if getattr(self, n) == need and not key
        ]:
            raise ConfigError(f"--{name_missing[0]} needs its API key in the environment")
        if self.llm == "openai" and not (self.openai_api_key or self.openai_base_url):
            raise ConfigError("--llm openai needs OPENAI_API_KEY or OPENAI_BASE_URL")
        if self.mode not in CONVERSATIONS:
            raise ConfigError(
                f"conversation must be one of {', '.join(CONVERSATIONS)}, not {self.mode!r}"
            )
        if self.realtime_turns not in REALTIME_TURNS:
            raise ConfigError(f"realtime_turns must be one of {', '.join(REALTIME_TURNS)}")
        if self.realtime_session_s <= 0:
            raise ConfigError("realtime_session_s must be > 0")
        if self.mode == "openai-realtime" and not (self.openai_api_key or self.openai_base_url):
            raise ConfigError(
                "--conversation openai-realtime needs OPENAI_API_KEY or OPENAI_BASE_URL"
            )
        if self.max_tokens < 1:
            raise ConfigError("max_tokens must be at least 1")
        if self.vad_hangover_ms < 100:
            raise ConfigError("vad_hangover_ms below 100 ms would cut callers off mid-sentence")
        if self.end_of_turn not in END_OF_TURNS:
            raise ConfigError(f"end_of_turn must be one of {', '.join(END_OF_TURNS)}")
        if not 0 <= self.complete_hangover_ms <= self.incomplete_hangover_ms <= 10_000:
            raise ConfigError(
                "need 0 <= complete_hangover_ms <= incomplete_hangover_ms <= 10000 (ms)"
            )
        if self.incomplete_hangover_ms < 100:
            raise ConfigError(
                "incomplete_hangover_ms below 100 ms would cut callers off mid-sentence"
            )


SECTIONS: dict[str, type] = {
    "server": ServerSettings,
    "access": AccessSettings,
    "media": MediaSettings,
    "engine": EngineSettings,
    "conversation": ConversationSettings,
}
SECTION_OF: dict[str, str] = {
    f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
}
if len(SECTION_OF) != sum(len(dataclasses.fields(c)) for c in SECTIONS.values()):
    raise AssertionError("a field name is in two sections of ServerConfig")


def _by_section(fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        if name not in SECTION_OF:
            raise TypeError(f"ServerConfig has no field {name!r}")
        grouped.setdefault(SECTION_OF[name], {})[name] = value
    return grouped


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    server: ServerSettings = field(default_factory=ServerSettings)
    access: AccessSettings = field(default_factory=AccessSettings)
    media: MediaSettings = field(default_factory=MediaSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    conversation: ConversationSettings = field(default_factory=ConversationSettings)

    def __post_init__(self) -> None:
        relay = self.media.turn_secret or any("@" in url for url in self.media.ice_servers)
        if relay and not self.access.api_key and not self.access.private_network:
            raise ConfigError(
                "TURN credentials without an API key: /ice-servers would hand a relay to "
                "anyone who asks. Set AVATAR_RTC_API_KEY or --api-key-file, or "
                "--private-network if only a private network reaches this server"
            )

    @classmethod
    def of(cls, **fields: Any) -> ServerConfig:
        """The defaults with these changes: fields named plainly (``port=0``,
        ``barge_in=False``) or whole sections (``engine=EngineSettings(name="warp")``)."""
        return cls().replace(**fields)

    def replace(self, **fields: Any) -> ServerConfig:
        """This config with these changes (as :meth:`of`), each section validated again."""
        sections = {name: fields.pop(name) for name in SECTIONS if name in fields}
        for name, values in _by_section(fields).items():
            sections[name] = dataclasses.replace(sections.get(name, getattr(self, name)), **values)
        return dataclasses.replace(self, **sections)
