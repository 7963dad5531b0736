"""Server configuration: one frozen object, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("auto", "warp", "sync-test")
STTS = ("auto", "local", "openai")
LLMS = ("auto", "echo", "openai")
TTSS = ("auto", "piper", "elevenlabs", "openai")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "avatar-rtc"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    avatar: Path | None = None
    """Portrait image or video; None for the built-in avatar."""
    engine: str = "auto"
    ice_addresses: tuple[str, ...] = ()
    """Host addresses ICE may gather; empty means every interface."""
    ice_servers: tuple[str, ...] = ()
    """STUN/TURN URLs (turn:user:password@host:port); none by default, nothing leaves the host."""
    max_sessions: int = 8
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
    vad_hangover_ms: int = 500
    """Silence after speech that ends the caller's turn."""
    barge_in: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("stt", STTS), ("llm", LLMS), ("tts", TTSS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if name_missing := [
            n
            for n, need, key in (
                ("stt", "openai", self.openai_api_key),
                ("tts", "openai", self.openai_api_key),
                ("tts", "elevenlabs", self.elevenlabs_api_key),
            )
            if getattr(self, n) == need and not key
        ]:
            raise ValueError(f"--{name_missing[0]} needs its API key in the environment")
        if self.llm == "openai" and not (self.openai_api_key or self.openai_base_url):
            raise ValueError("--llm openai needs OPENAI_API_KEY or OPENAI_BASE_URL")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.vad_hangover_ms < 100:
            raise ValueError("vad_hangover_ms below 100 ms would cut callers off mid-sentence")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, not {self.port}")
        if self.max_call_s <= 0 or self.rate_limit_per_min < 0:
            raise ValueError("max_call_s must be > 0 and rate_limit_per_min >= 0")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--cert-file and --key-file go together")
