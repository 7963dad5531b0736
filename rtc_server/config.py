"""Server configuration: one frozen object, validated once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from musetalk_core.types import AvatarRtcError
from signaling.access import ORIGIN

ENGINES = ("auto", "musetalk", "warp", "sync-test")
STTS = ("auto", "local", "openai")
LLMS = ("auto", "echo", "openai")
TTSS = ("auto", "piper", "elevenlabs", "openai")


class ConfigError(AvatarRtcError, ValueError):
    """A configuration the server cannot run with; the message names the option."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "avatar-rtc"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    avatar: Path | None = None
    """Portrait image or video; None for the built-in avatar."""
    engine: str = "auto"
    weights_dir: Path | None = None
    """MuseTalk weights (layout in musetalk_core.weights); None: the default cache folder."""
    musetalk_device: str = "auto"
    """auto (CUDA when present), cuda, cuda:N or cpu."""
    musetalk_batch: int = 16
    """Largest MuseTalk batch, shared by all calls."""
    musetalk_compile: bool = False
    """torch.compile the UNet and VAE decoder (slow start, faster steady state on CUDA)."""
    ice_addresses: tuple[str, ...] = ()
    """Host addresses ICE may gather; empty means every interface."""
    ice_servers: tuple[str, ...] = ()
    """STUN/TURN URLs (turn:user:password@host:port); none by default, nothing leaves the host."""
    max_sessions: int = 8
    headroom: bool = True
    """Refuse a new call (503 at_capacity) when this process has no headroom left for it:
    event-loop lag, CPU plus the measured cost of a call, engines not keeping up."""
    cpu_limit: float | None = None
    """Cores this process may use for calls; None: 90 % of its share of the machine."""
    still_repeat_s: float = 0.25
    """While the avatar is idle and its picture does not change, a video frame goes out only
    this often (0: every frame, 25 fps always)."""
    piper_deterministic: bool = False
    """The local voice without its sampled variation: the same text always gives the same
    audio (tests and benchmarks compare a reply with the same sentence alone)."""
    connect_timeout_s: float = 30.0
    cache_dir: Path = field(default_factory=default_cache_dir)
    cert_file: Path | None = None
    key_file: Path | None = None
    allowed_origins: tuple[str, ...] = ()
    """Browser origins besides the server's own that may call the API ("*": any)."""
    api_key: str | None = field(default=None, repr=False)
    rate_limit_per_min: int = 60
    """/offer and /token requests per client address and minute, in bursts of up to a third
    of that (0: no limit)."""
    idle_timeout_s: float = 300.0
    """A call with no caller speech, typed text or say for this long is closed (0: never)."""
    max_say_chars: int = 2000
    """Longest text of a say or a typed turn, over HTTP or the data channel."""
    turn_secret: str | None = field(default=None, repr=False)
    """coturn's static-auth-secret: time-limited TURN credentials are minted from it."""
    turn_urls: tuple[str, ...] = ()
    """TURN URLs the minted credentials are for (turn:host:3478?transport=udp)."""
    turn_ttl_s: int = 3600
    """How long minted TURN credentials stay valid."""
    public_address: str | None = None
    """NAT 1:1: the address announced in host candidates instead of the gathered one."""
    log_format: str = "text"
    """"text", or "json": one JSON object a line (rtc_server/logs.py)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long running calls may go on before they are closed."""
    max_call_s: float = 3600.0
    """A call is closed after this long."""
    """Turns token auth on: /offer then needs a token minted by POST /token."""
    stt: str = "auto"
    llm: str = "auto"
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
    provider_attempts: int = 3
    """Tries per cloud request when the error is retryable (429, 5xx, timeouts)."""
    provider_backoff_s: float = 0.25
    """First wait between tries; it doubles each time."""
    provider_read_timeout_s: float = 15.0
    """Longest silence of a cloud provider mid-answer (or before its first byte) before the
    request fails: a reply whose LLM or TTS stalls gets an error and the spoken apology."""
    vad_hangover_ms: int = 500
    """Silence after speech that ends the caller's turn."""
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
        if self.max_tokens < 1:
            raise ConfigError("max_tokens must be at least 1")
        if self.vad_hangover_ms < 100:
            raise ConfigError("vad_hangover_ms below 100 ms would cut callers off mid-sentence")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if not 1 <= self.musetalk_batch <= 256:
            raise ConfigError("--musetalk-batch must be 1..256")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be 1..65535, not {self.port}")
        if self.max_call_s <= 0 or self.rate_limit_per_min < 0:
            raise ConfigError("max_call_s must be > 0 and rate_limit_per_min >= 0")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("--cert-file and --key-file go together")
        for origin in self.allowed_origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ConfigError(
                    f"--allowed-origin must be scheme://host[:port] (no path), not {origin!r}"
                )
        if self.idle_timeout_s < 0 or self.drain_timeout_s < 0:
            raise ConfigError("idle_timeout_s and drain_timeout_s must be >= 0")
        if self.max_say_chars < 1:
            raise ConfigError("max_say_chars must be at least 1")
        if bool(self.turn_secret) != bool(self.turn_urls):
            raise ConfigError("--turn-secret and --turn-url go together")
        for url in self.turn_urls:
            if not url.startswith(("turn:", "turns:")) or "@" in url:
                raise ConfigError(f"--turn-url must be turn:host:port or turns:..., not {url!r}")
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
