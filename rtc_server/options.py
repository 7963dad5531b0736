"""The options of ``avatar-rtc serve``, declared once.

:data:`SERVE_OPTIONS` is the one table: each option's flag, type, default, environment
variable (``AVATAR_RTC_<FLAG>``), help and the config field it fills. The command line
(:func:`add_options`), the environment's parsing (:func:`env_default`, errors as
:class:`EnvError`), the :class:`~rtc_server.config.ServerConfig` (:func:`config_from`) and the
README's options section (:func:`markdown`, ``python -m rtc_server.options``) all come from it.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from musetalk_core.framing import FRAMINGS
from rtc_server.config import (
    CONVERSATIONS,
    END_OF_TURNS,
    ENGINES,
    LLMS,
    REALTIME_TURNS,
    SECTIONS,
    STTS,
    TTSS,
    ConfigError,
    ServerConfig,
    default_cache_dir,
)
from rtc_server.logs import LOG_FORMATS


class EnvError(ConfigError):
    """An ``AVATAR_RTC_*`` variable whose value its option cannot take."""


class Kind(enum.Enum):
    VALUE = "value"
    SWITCH = "switch"
    """``--flag`` alone turns it on; in the environment 1/true/yes/on or 0/false/no/off."""
    LIST = "list"
    """Repeatable; in the environment a comma-separated list."""


GROUPS = {
    "server": "the HTTP server and its processes",
    "access": "who may call",
    "media": "how media reaches the caller",
    "engine": "the avatar and its lip-sync engine",
    "conversation": "speech in and out; keys come from OPENAI_API_KEY, OPENAI_BASE_URL and "
    "ELEVENLABS_API_KEY",
}


@dataclass(frozen=True, slots=True)
class Option:
    flag: str
    """Without the dashes: ``max-sessions``."""
    group: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    kind: Kind = Kind.VALUE
    choices: tuple[str, ...] | None = None
    field: str | None = None
    """The field it fills in its group's section of ServerConfig (default: the flag with
    underscores; a LIST's field is its plural, given here)."""
    to_config: Callable[[Any], Any] | None = None
    """How the parsed value becomes the field's (default: as it is)."""
    in_config: bool = True
    """False: the command reads it itself (``--workers`` shapes the processes)."""
    secret: bool = False
    """A key: from the environment (``AVATAR_RTC_<FLAG>``) or a file (``--<flag>-file``,
    ``AVATAR_RTC_<FLAG>_FILE``), never from the command line, which every user of the machine
    can read (``ps``, ``/proc/<pid>/cmdline``)."""

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env(self) -> str:
        return "AVATAR_RTC_" + self.flag.upper().replace("-", "_")

    @property
    def cli_flag(self) -> str:
        """The flag on the command line: a secret's names its file."""
        return self.flag + "-file" if self.secret else self.flag


class _RefusedOnCommandLine(argparse.Action):
    """A secret given as a flag's value: refused, saying where it goes."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        flag = self.option_strings[0]
        parser.error(
            f"{flag} does not take the key on the command line, where every user of this "
            f"machine can read it: set {self.metavar} or give {flag}-file PATH"
        )


def add_secret_argument(group: Any, o: Option, environ: Mapping[str, str]) -> None:
    """``--<flag>-file PATH`` (default ``AVATAR_RTC_<FLAG>_FILE``), and ``--<flag>`` refused."""
    group.add_argument(
        f"--{o.cli_flag}",
        default=environ.get(o.env + "_FILE") or None,
        metavar="PATH",
        help=o.help.replace("%", "%%") + f" [{o.env}, or the file in {o.env}_FILE]",
    )
    group.add_argument(
        f"--{o.flag}", action=_RefusedOnCommandLine, metavar=o.env, help=argparse.SUPPRESS
    )


def secret_from(o: Option, path: str | None, environ: Mapping[str, str]) -> str | None:
    """A secret option's value: from its file, or from its variable; None when neither."""
    given = environ.get(o.env, "").strip() or None
    if path is None:
        return given
    if given is not None:
        raise ConfigError(f"{o.env} and --{o.cli_flag} are both set: give the key once")
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--{o.cli_flag} {path}: cannot read it ({exc})") from None
    if not value:
        raise ConfigError(f"--{o.cli_flag} {path} is empty")
    return value


def _or_none(value: Any) -> Any:
    return value or None


def _not(value: bool) -> bool:
    return not value


SERVE_OPTIONS: tuple[Option, ...] = (
    Option("host", "server", "address to listen on", default="127.0.0.1"),
    Option("port", "server", "port to listen on", int, 8080),
    Option(
        "workers",
        "server",
        "media worker processes behind one HTTP front, each loading its own speech models, "
        "MuseTalk in one engine process per GPU (0: one per core; 1: a single process, no front)",
        int,
        0,
        in_config=False,
    ),
    Option("max-sessions", "server", "concurrent calls of the whole server (all workers)", int, 8),
    Option(
        "cpu-limit",
        "server",
        "cores a process may use before it refuses new calls with 503 at_capacity "
        "(unset or 0: 90 % of its share of the cores)",
        float,
        None,
        to_config=_or_none,
    ),
    Option(
        "no-headroom",
        "server",
        "take calls up to --max-sessions whatever the load (no admission by headroom)",
        kind=Kind.SWITCH,
        field="headroom",
        to_config=_not,
    ),
    Option(
        "drain-timeout-s",
        "server",
        "on SIGTERM, take no new calls and let running ones go on this long, then exit",
        float,
        30.0,
    ),
    Option(
        "log-format",
        "server",
        "text, or one JSON object a line (time, level, logger, message, session)",
        default="text",
        choices=LOG_FORMATS,
    ),
    Option(
        "metrics-port",
        "server",
        "serve /metrics and /readyz's details on this port of --metrics-host only, not on the "
        "public one (0: on --port, to whoever reaches it)",
        int,
        0,
    ),
    Option(
        "metrics-host",
        "server",
        "address of the --metrics-port listener",
        default="127.0.0.1",
    ),
    Option(
        "connect-timeout-s",
        "server",
        "close a call whose peer has not connected this many seconds after the answer",
        float,
        10.0,
    ),
    Option("max-call-s", "server", "calls are closed after this many seconds", float, 3600.0),
    Option(
        "resume-grace-s",
        "server",
        "a call whose link is lost can be resumed (POST /sessions/{id}/resume) this many seconds"
        " after the caller was last heard; then it is freed (0: never resumed)",
        float,
        20.0,
    ),
    Option(
        "idle-timeout-s",
        "server",
        "close a call after this many seconds without caller speech, text or say (0: never)",
        float,
        300.0,
    ),
    Option(
        "max-say-chars",
        "server",
        "longest text of a say or a typed turn (HTTP 413 / an error event beyond)",
        int,
        2000,
    ),
    Option(
        "cache-dir",
        "server",
        "prepared avatars and other caches (unset: ~/.cache/avatar-rtc)",
        Path,
        None,
        to_config=lambda v: v or default_cache_dir(),
    ),
    Option("cert-file", "server", "HTTPS certificate (PEM), with --key-file", Path),
    Option("key-file", "server", "HTTPS private key (PEM), with --cert-file", Path),
    Option(
        "allowed-origin",
        "access",
        "browser origin (scheme://host:port) that may call the API besides the server's own "
        "(repeatable)",
        kind=Kind.LIST,
        field="allowed_origins",
    ),
    Option(
        "api-key",
        "access",
        "file holding the key that turns token auth on (POST /token with it mints call "
        "tokens); at least 32 characters, e.g. `openssl rand -hex 32`",
        secret=True,
    ),
    Option(
        "private-network",
        "access",
        "only a private network reaches this server: it may hand out TURN credentials "
        "without an API key",
        kind=Kind.SWITCH,
    ),
    Option(
        "rate-limit-per-min",
        "access",
        "/offer and /token requests per client address and minute (0: no limit)",
        int,
        60,
    ),
    Option(
        "trusted-proxy",
        "access",
        "address or CIDR of a proxy in front of the server whose X-Forwarded-For, -Proto and "
        "-Host are believed (repeatable; unset: none)",
        kind=Kind.LIST,
        field="trusted_proxies",
    ),
    Option(
        "public-origin",
        "access",
        "the origin callers use (https://avatar.example.com): the server's own origin and the "
        "one host name it answers for",
        to_config=_or_none,
    ),
    Option(
        "max-calls-per-client",
        "access",
        "live calls one client address may hold, an IPv6 client's whole /64 (0: no limit)",
        int,
        2,
    ),
    Option(
        "max-calls-per-token",
        "access",
        "live calls one token may open, with an API key (0: no limit)",
        int,
        1,
    ),
    Option(
        "call-messages-per-min",
        "access",
        "says and data-channel messages per call and minute, in bursts of a third of that "
        "(0: no limit)",
        int,
        60,
    ),
    Option(
        "ice-address",
        "media",
        "host address ICE may use (repeatable; unset: all interfaces)",
        kind=Kind.LIST,
        field="ice_addresses",
    ),
    Option(
        "ice-server",
        "media",
        "STUN/TURN server, stun:host:port or turn:user:password@host:port (repeatable)",
        kind=Kind.LIST,
        field="ice_servers",
    ),
    Option(
        "turn-secret",
        "media",
        "file holding coturn's static-auth-secret: mint time-limited TURN credentials for "
        "--turn-url; at least 32 characters",
        secret=True,
    ),
    Option(
        "turn-url",
        "media",
        "TURN server for minted credentials, turn:host:3478?transport=udp (repeatable)",
        kind=Kind.LIST,
        field="turn_urls",
    ),
    Option("turn-ttl-s", "media", "how long minted TURN credentials stay valid", int, 3600),
    Option(
        "public-address",
        "media",
        "NAT 1:1: IP announced in host candidates instead of the local one (ports kept)",
        to_config=_or_none,
    ),
    Option(
        "peer-network",
        "media",
        "network (CIDR) of callers' private addresses whose offered candidates the server may "
        "check, besides public ones (repeatable; a server on loopback takes all)",
        kind=Kind.LIST,
        field="peer_networks",
    ),
    Option("avatar", "engine", "portrait image or video (unset: the built-in avatar)", Path, None),
    Option(
        "framing",
        "engine",
        "head: head and shoulders at 512x512, the face a third to half the width; full: the "
        "whole picture",
        default="head",
        choices=FRAMINGS,
    ),
    Option(
        "engine", "engine", "the lip-sync engine", default="auto", choices=ENGINES, field="name"
    ),
    Option(
        "weights-dir",
        "engine",
        "MuseTalk weights (unset: ~/.cache/avatar-rtc/musetalk)",
        Path,
        None,
    ),
    Option(
        "musetalk-device",
        "engine",
        "auto (CUDA when present), cuda, cuda:N or cpu",
        default="auto",
    ),
    Option("musetalk-batch", "engine", "largest MuseTalk batch, shared by all calls", int, 16),
    Option(
        "musetalk-compile",
        "engine",
        "torch.compile the UNet and VAE decoder (slow start, faster on CUDA)",
        kind=Kind.SWITCH,
    ),
    Option(
        "conversation",
        "conversation",
        "pipeline (STT, LLM, TTS) or openai-realtime (one speech-to-speech model; never picked "
        "by auto)",
        default="pipeline",
        choices=CONVERSATIONS,
        field="mode",
    ),
    Option("realtime-model", "conversation", "the Realtime model", default="gpt-realtime"),
    Option("realtime-voice", "conversation", "the Realtime model's voice", default="marin"),
    Option(
        "realtime-transcription-model",
        "conversation",
        "transcribes the caller in Realtime calls (empty: no transcripts)",
        default="gpt-4o-mini-transcribe",
    ),
    Option(
        "realtime-turns",
        "conversation",
        "who ends the caller's turn in Realtime calls: ours (the server's VAD) or service",
        default="ours",
        choices=REALTIME_TURNS,
    ),
    Option(
        "realtime-session-s",
        "conversation",
        "age at which a call's Realtime connection is renewed between turns, the conversation "
        "carried over (the service's limit is 60 minutes)",
        float,
        3000.0,
    ),
    Option("stt", "conversation", "speech recognition", default="auto", choices=STTS),
    Option("llm", "conversation", "the replies' language model", default="auto", choices=LLMS),
    Option("tts", "conversation", "the voice", default="auto", choices=TTSS),
    Option("llm-model", "conversation", "the OpenAI-compatible model", default="gpt-4o-mini"),
    Option("max-tokens", "conversation", "cap on each reply's length", int, 150),
    Option(
        "system-prompt",
        "conversation",
        "the LLM's instructions (unset: a short built-in prompt asking for one or two spoken "
        "sentences)",
    ),
    Option("openai-tts-voice", "conversation", "OpenAI TTS voice", default="alloy"),
    Option("elevenlabs-voice", "conversation", "ElevenLabs voice id"),
    Option(
        "piper-deterministic",
        "conversation",
        "the local voice without its sampled variation: the same text, the same audio "
        "(benchmarks and tests)",
        kind=Kind.SWITCH,
    ),
    Option(
        "vad-hangover-ms",
        "conversation",
        "silence that ends the caller's turn when no end-of-turn model judges it",
        int,
        500,
    ),
    Option(
        "end-of-turn",
        "conversation",
        "who decides that the caller has finished: the Smart Turn model at each pause "
        "(smart-turn), the fixed hang-over (off), the model when installed (auto)",
        default="auto",
        choices=END_OF_TURNS,
    ),
    Option(
        "complete-hangover-ms",
        "conversation",
        "silence that ends a turn the end-of-turn model judges finished",
        int,
        300,
    ),
    Option(
        "incomplete-hangover-ms",
        "conversation",
        "silence that ends a turn the end-of-turn model judges unfinished",
        int,
        1200,
    ),
    Option(
        "no-speculation",
        "conversation",
        "do not start the reply at the caller's pause (each discarded start costs one LLM "
        "request and one sentence of TTS)",
        kind=Kind.SWITCH,
        field="speculate",
        to_config=_not,
    ),
    Option(
        "no-barge-in",
        "conversation",
        "do not stop the avatar when the caller starts speaking",
        kind=Kind.SWITCH,
        field="barge_in",
        to_config=_not,
    ),
)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def option(flag: str) -> Option:
    for o in SERVE_OPTIONS:
        if o.flag == flag:
            return o
    raise KeyError(flag)


def env_default(o: Option, environ: Mapping[str, str]) -> Any:
    """``o``'s value from the environment, parsed as its flag's would be; unset: its default."""
    raw = environ.get(o.env)
    if o.kind is Kind.LIST:
        return [v.strip() for v in raw.split(",") if v.strip()] if raw else []
    if o.kind is Kind.SWITCH:
        word = (raw or "").strip().lower()
        if word in _FALSE:
            return False
        if word in _TRUE:
            return True
        raise EnvError(f"{o.env}={raw!r}: use 1/true/yes/on or 0/false/no/off")
    if raw is None or not raw.strip():
        return o.default
    try:
        value = o.type(raw.strip())
    except ValueError:
        what = "a whole number" if o.type is int else "a number" if o.type is float else "valid"
        raise EnvError(f"{o.env}={raw!r}: not {what}") from None
    if o.choices is not None and value not in o.choices:
        raise EnvError(f"{o.env}={raw!r}: one of {', '.join(o.choices)}")
    return value


def add_options(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], options: Iterable[Option]
) -> None:
    """The options' flags, in their groups, each defaulting to its environment variable."""
    groups: dict[str, Any] = {}
    for o in options:
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(o.group, GROUPS[o.group])
        group = groups[o.group]
        name, helptext = "--" + o.flag, o.help.replace("%", "%%") + f" [{o.env}]"
        if o.secret:
            add_secret_argument(group, o, environ)
        elif o.kind is Kind.SWITCH:
            group.add_argument(
                name, action="store_true", default=env_default(o, environ), help=helptext
            )
        elif o.kind is Kind.LIST:
            # The environment's list is merged in config_from: argparse would append the
            # command line's values to it instead of replacing it.
            env_default(o, environ)
            group.add_argument(name, action="append", default=None, help=helptext)
        else:
            group.add_argument(
                name,
                type=o.type,
                choices=o.choices,
                default=env_default(o, environ),
                help=helptext,
            )


def config_from(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    """The server's config from parsed ``serve`` flags; the provider keys from the environment.
    Each option fills its field in the section its group names."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for o in SERVE_OPTIONS:
        if not o.in_config:
            continue
        value = getattr(args, o.cli_flag.replace("-", "_"))
        if o.secret:
            value = secret_from(o, value, environ)
        if o.kind is Kind.LIST:
            value = tuple(value or env_default(o, environ))
        if o.to_config is not None:
            value = o.to_config(value)
        sections[o.group][o.field or o.dest] = value
    sections["conversation"].update(
        openai_api_key=environ.get("OPENAI_API_KEY") or None,
        openai_base_url=environ.get("OPENAI_BASE_URL") or None,
        elevenlabs_api_key=environ.get("ELEVENLABS_API_KEY") or None,
        elevenlabs_base_url=environ.get("ELEVENLABS_BASE_URL") or None,
    )
    return ServerConfig(**{name: SECTIONS[name](**values) for name, values in sections.items()})


def _shown_default(o: Option) -> str:
    if o.kind is Kind.SWITCH:
        return "off"
    if o.kind is Kind.LIST or o.default is None:
        return ""
    return f"`{o.default}`"


def markdown() -> str:
    """The README's options section: every option, its variable and default, by group."""
    lines = []
    for group, about in GROUPS.items():
        lines += [f"**{group}**: {about}", "", "| flag | environment | default | meaning |"]
        lines.append("| --- | --- | --- | --- |")
        for o in SERVE_OPTIONS:
            if o.group != group:
                continue
            flag = f"`--{o.cli_flag}`" + (f" ({', '.join(o.choices)})" if o.choices else "")
            meaning = o.help.replace("|", "\\|")
            env = f"`{o.env}`, `{o.env}_FILE`" if o.secret else f"`{o.env}`"
            lines.append(f"| {flag} | {env} | {_shown_default(o)} | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
