"""Server configuration: one frozen object, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("auto", "warp")


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

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1..65535, not {self.port}")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--cert-file and --key-file go together")
