"""``avatar-rtc``: serve, prepare-avatar, download-weights, doctor, token, bench.

Every flag can also come from the environment as ``AVATAR_RTC_<FLAG>`` (dashes as underscores;
repeatable flags take a comma-separated list). A flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rtc_server.config import ENGINES, LLMS, STTS, TTSS, ServerConfig, default_cache_dir

if TYPE_CHECKING:
    from rtc_server.engines import EngineFactory


N = TypeVar("N", int, float)


class EnvError(ValueError):
    """An ``AVATAR_RTC_*`` variable whose value its option cannot take."""


def _env_name(flag: str) -> str:
    return "AVATAR_RTC_" + flag.upper().replace("-", "_")


def _env(environ: Mapping[str, str], flag: str) -> str | None:
    return environ.get(_env_name(flag))


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _env_flag(environ: Mapping[str, str], flag: str) -> bool:
    """A switch from the environment: 1/true/yes/on or 0/false/no/off (any case); unset: off."""
    raw = _env(environ, flag)
    if raw is None or raw.strip().lower() in _FALSE:
        return False
    if raw.strip().lower() in _TRUE:
        return True
    raise EnvError(f"{_env_name(flag)}={raw!r}: use 1/true/yes/on or 0/false/no/off")


def _env_number(environ: Mapping[str, str], flag: str, default: N, kind: type[N]) -> N:
    raw = _env(environ, flag)
    if raw is None or not raw.strip():
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise EnvError(f"{_env_name(flag)}={raw!r}: not {what}") from None


def _env_int(environ: Mapping[str, str], flag: str, default: int) -> int:
    return _env_number(environ, flag, default, int)


def _env_float(environ: Mapping[str, str], flag: str, default: float) -> float:
    return _env_number(environ, flag, float(default), float)


def _env_list(environ: Mapping[str, str], flag: str) -> list[str]:
    value = _env(environ, flag)
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="avatar-rtc", description=__doc__, formatter_class=fmt)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the call page and WebRTC API", formatter_class=fmt)
    serve.add_argument("--host", default=_env(environ, "host") or "127.0.0.1")
    serve.add_argument("--port", type=int, default=_env_int(environ, "port", 8080))
    serve.add_argument(
        "--avatar",
        type=Path,
        default=_env(environ, "avatar"),
        help="portrait image or video (default: the built-in avatar)",
    )
    serve.add_argument("--engine", choices=ENGINES, default=_env(environ, "engine") or "auto")
    _musetalk_flags(serve, environ)
    serve.add_argument(
        "--musetalk-batch",
        type=int,
        default=_env_int(environ, "musetalk-batch", 16),
        help="largest MuseTalk batch, shared by all calls",
    )
    serve.add_argument(
        "--musetalk-compile",
        action="store_true",
        default=_env_flag(environ, "musetalk-compile"),
        help="torch.compile the UNet and VAE decoder (slow start, faster on CUDA)",
    )
    serve.add_argument(
        "--ice-address",
        action="append",
        default=None,
        help="host address ICE may use (repeatable; default: all interfaces)",
    )
    serve.add_argument(
        "--ice-server",
        action="append",
        default=None,
        help="STUN/TURN server, stun:host:port or turn:user:password@host:port (repeatable)",
    )
    serve.add_argument(
        "--max-sessions",
        type=int,
        default=_env_int(environ, "max-sessions", 8),
        help="concurrent calls of the whole server (all workers together)",
    )
    serve.add_argument(
        "--cpu-limit",
        type=float,
        default=_env_float(environ, "cpu-limit", 0) or None,
        help="cores a process may use before it refuses new calls with 503 at_capacity "
        "(default: 90%% of its share of the cores)",
    )
    serve.add_argument(
        "--no-headroom",
        action="store_true",
        default=_env_flag(environ, "no-headroom"),
        help="take calls up to --max-sessions whatever the load (no admission by headroom)",
    )
    serve.add_argument(
        "--piper-deterministic",
        action="store_true",
        default=_env_flag(environ, "piper-deterministic"),
        help="the local voice without its sampled variation: the same text, the same audio "
        "(benchmarks and tests)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=_env_int(environ, "workers", 0),
        help="media worker processes behind one HTTP front, each loading its own models "
        "(0: one per core; 1: a single process, no front)",
    )
    serve.add_argument(
        "--allowed-origin",
        action="append",
        default=None,
        help="browser origin (scheme://host:port) that may call the API besides the server's "
        "own (repeatable)",
    )
    serve.add_argument(
        "--api-key",
        default=_env(environ, "api-key"),
        help="turn token auth on: POST /token with this key mints call tokens",
    )
    serve.add_argument(
        "--max-call-s",
        type=float,
        default=_env_float(environ, "max-call-s", 3600),
        help="calls are closed after this many seconds",
    )
    serve.add_argument(
        "--rate-limit-per-min",
        type=int,
        default=_env_int(environ, "rate-limit-per-min", 60),
        help="/offer and /token requests per client address and minute (0: no limit)",
    )
    serve.add_argument(
        "--idle-timeout-s",
        type=float,
        default=_env_float(environ, "idle-timeout-s", 300),
        help="close a call after this many seconds without caller speech, text or say (0: never)",
    )
    serve.add_argument(
        "--max-say-chars",
        type=int,
        default=_env_int(environ, "max-say-chars", 2000),
        help="longest text of a say or a typed turn (HTTP 413 / an error event beyond)",
    )
    serve.add_argument(
        "--drain-timeout-s",
        type=float,
        default=_env_float(environ, "drain-timeout-s", 30),
        help="on SIGTERM, take no new calls and let running ones go on this long, then exit",
    )
    serve.add_argument(
        "--turn-secret",
        default=_env(environ, "turn-secret"),
        help="coturn's static-auth-secret: mint time-limited TURN credentials for --turn-url",
    )
    serve.add_argument(
        "--turn-url",
        action="append",
        default=None,
        help="TURN server for minted credentials, turn:host:3478?transport=udp (repeatable)",
    )
    serve.add_argument(
        "--turn-ttl-s",
        type=int,
        default=_env_int(environ, "turn-ttl-s", 3600),
        help="how long minted TURN credentials stay valid",
    )
    serve.add_argument(
        "--public-address",
        default=_env(environ, "public-address"),
        help="NAT 1:1: IP announced in host candidates instead of the local one (ports kept)",
    )
    serve.add_argument("--cache-dir", type=Path, default=_env(environ, "cache-dir"))
    serve.add_argument("--cert-file", type=Path, default=_env(environ, "cert-file"))
    serve.add_argument("--key-file", type=Path, default=_env(environ, "key-file"))
    talk = serve.add_argument_group(
        "conversation", "keys come from OPENAI_API_KEY, OPENAI_BASE_URL and ELEVENLABS_API_KEY"
    )
    talk.add_argument("--stt", choices=STTS, default=_env(environ, "stt") or "auto")
    talk.add_argument("--llm", choices=LLMS, default=_env(environ, "llm") or "auto")
    talk.add_argument("--tts", choices=TTSS, default=_env(environ, "tts") or "auto")
    talk.add_argument("--llm-model", default=_env(environ, "llm-model") or "gpt-4o-mini")
    talk.add_argument(
        "--max-tokens",
        type=int,
        default=_env_int(environ, "max-tokens", 150),
        help="cap on each reply's length",
    )
    talk.add_argument(
        "--system-prompt",
        default=_env(environ, "system-prompt"),
        help="(default: a short built-in prompt asking for one or two spoken sentences)",
    )
    talk.add_argument("--openai-tts-voice", default=_env(environ, "openai-tts-voice") or "alloy")
    talk.add_argument("--elevenlabs-voice", default=_env(environ, "elevenlabs-voice"))
    talk.add_argument(
        "--vad-hangover-ms",
        type=int,
        default=_env_int(environ, "vad-hangover-ms", 500),
        help="silence that ends the caller's turn",
    )
    talk.add_argument(
        "--no-barge-in",
        action="store_true",
        default=_env_flag(environ, "no-barge-in"),
        help="do not stop the avatar when the caller starts speaking",
    )

    prep = sub.add_parser(
        "prepare-avatar",
        help="find the face, build the engine's material (MuseTalk latents and masks), cache it",
        formatter_class=fmt,
    )
    prep.add_argument("source", type=Path, help="portrait image or video")
    prep.add_argument("--out", type=Path, default=None, help="cache directory")
    prep.add_argument(
        "--engine",
        choices=("auto", "musetalk", "warp"),
        default="auto",
        help="auto: MuseTalk material too when its weights are present",
    )
    _musetalk_flags(prep, environ)
    prep.add_argument("--bbox-shift", type=int, default=0, help="MuseTalk: move the face top")
    prep.add_argument("--extra-margin", type=int, default=10, help="MuseTalk: pixels below chin")

    weights = sub.add_parser(
        "download-weights", help="fetch MuseTalk 1.5 weights and check them", formatter_class=fmt
    )
    weights.add_argument("--dir", type=Path, default=_env(environ, "weights-dir"))
    weights.add_argument(
        "--verify", action="store_true", help="only rehash what is there against the manifest"
    )

    sub.add_parser("doctor", help="say which engine, providers and codecs would be used, and why")

    tok = sub.add_parser("token", help="mint a call token for a server started with --api-key")
    tok.add_argument("--api-key", default=_env(environ, "api-key"), help="the server's key")
    tok.add_argument("--ttl-s", type=int, default=300)
    tok.add_argument("--avatar", default=None, help="limit the token to this avatar")

    bench = sub.add_parser("bench", help="benchmarks (see benchmarks/README.md)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    try:
        config = _config(args, environ)
    except ValueError as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    workers = args.workers or cores()
    if not 1 <= workers <= 256:
        print("avatar-rtc: error: --workers must be 0..256", file=sys.stderr)
        return 2
    if workers > 1:
        # The front loads no models: the first worker checks the portrait and the ICE
        # servers, and its error (exit 2) stops start-up as it would here.
        from rtc_server.workers.front import run_front

        return run_front(config, workers=workers, verbose=args.verbose)
    return _serve_alone(config)


def cores() -> int:
    """CPUs this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def prepare(config: ServerConfig) -> EngineFactory:
    """What a server checks before serving: the ICE servers, the portrait (the engine factory).

    Raises ValueError or ``musetalk_core.avatar.AvatarError`` with a message for the user.
    """
    from rtc_server.engines import load_engine_factory
    from rtc_server.ice import IceServers

    IceServers.from_config(config.ice_servers)  # a malformed --ice-server stops here
    # Prepared here, before serving, so a bad portrait stops start-up with its reason.
    return load_engine_factory(config)


def _serve_alone(config: ServerConfig) -> int:
    import asyncio

    from musetalk_core.avatar import AvatarError
    from rtc_server.app import create_app
    from rtc_server.serving import serve

    try:
        factory = prepare(config)
    except (ValueError, AvatarError) as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    ssl_context = server_ssl_context(config)
    quiet_telemetry()
    app = create_app(config, engine_loader=lambda: factory)
    scheme = "https" if ssl_context else "http"
    url = f"{scheme}://{config.host}:{config.port}"
    # SIGTERM drains: no new calls, running ones go on up to --drain-timeout-s, then exit 0.
    asyncio.run(
        serve(
            app,
            host=config.host,
            port=config.port,
            drain_timeout_s=config.drain_timeout_s,
            ssl_context=ssl_context,
            on_started=lambda: print(f"avatar-rtc: serving on {url}", flush=True),
        )
    )
    return 0


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.cert_file is None or config.key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.cert_file, config.key_file)
    return context


def _config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        avatar=args.avatar,
        engine=args.engine,
        weights_dir=args.weights_dir,
        musetalk_device=args.musetalk_device,
        musetalk_batch=args.musetalk_batch,
        musetalk_compile=args.musetalk_compile,
        ice_addresses=tuple(args.ice_address or _env_list(environ, "ice-address")),
        ice_servers=tuple(args.ice_server or _env_list(environ, "ice-server")),
        max_sessions=args.max_sessions,
        headroom=not args.no_headroom,
        cpu_limit=args.cpu_limit,
        piper_deterministic=args.piper_deterministic,
        cache_dir=args.cache_dir or default_cache_dir(),
        cert_file=args.cert_file,
        key_file=args.key_file,
        allowed_origins=tuple(args.allowed_origin or _env_list(environ, "allowed-origin")),
        api_key=args.api_key or None,
        max_call_s=args.max_call_s,
        rate_limit_per_min=args.rate_limit_per_min,
        idle_timeout_s=args.idle_timeout_s,
        max_say_chars=args.max_say_chars,
        drain_timeout_s=args.drain_timeout_s,
        turn_secret=args.turn_secret or None,
        turn_urls=tuple(args.turn_url or _env_list(environ, "turn-url")),
        turn_ttl_s=args.turn_ttl_s,
        public_address=args.public_address or None,
        stt=args.stt,
        llm=args.llm,
        tts=args.tts,
        openai_api_key=environ.get("OPENAI_API_KEY") or None,
        openai_base_url=environ.get("OPENAI_BASE_URL") or None,
        elevenlabs_api_key=environ.get("ELEVENLABS_API_KEY") or None,
        elevenlabs_base_url=environ.get("ELEVENLABS_BASE_URL") or None,
        llm_model=args.llm_model,
        max_tokens=args.max_tokens,
        system_prompt=args.system_prompt,
        openai_tts_voice=args.openai_tts_voice,
        elevenlabs_voice=args.elevenlabs_voice,
        vad_hangover_ms=args.vad_hangover_ms,
        barge_in=not args.no_barge_in,
    )


def quiet_telemetry() -> None:
    # onnxruntime (Piper) otherwise looks up a telemetry host: offline means nothing leaves.
    try:
        import onnxruntime

        onnxruntime.disable_telemetry_events()
    except (ImportError, AttributeError):
        pass


def _musetalk_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "--weights-dir",
        type=Path,
        default=_env(environ, "weights-dir"),
        help="MuseTalk weights (default: ~/.cache/avatar-rtc/musetalk)",
    )
    parser.add_argument(
        "--musetalk-device",
        default=_env(environ, "musetalk-device") or "auto",
        help="auto (CUDA when present), cuda, cuda:N or cpu",
    )


def _prepare(args: argparse.Namespace) -> int:
    from musetalk_core.avatar import AvatarError, load_portrait, prepare_avatar
    from musetalk_core.weights import WeightsError

    out = args.out or default_cache_dir() / "avatars"
    try:
        avatar = prepare_avatar(load_portrait(args.source), cache_dir=out)
        x, y, w, h = avatar.mouth_box
        print(f"warp: {args.source}: mouth at x={x} y={y} w={w} h={h}; cached in {out}")
        if args.engine != "warp":
            return _prepare_musetalk(args)
    except (AvatarError, WeightsError) as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _prepare_musetalk(args: argparse.Namespace) -> int:
    from musetalk_core.material import prepare_musetalk_avatar
    from musetalk_core.models import load_models, resolve_placement
    from musetalk_core.weights import WeightsError, check_layout, weights_id
    from rtc_server.engines import weights_dir

    config = ServerConfig(weights_dir=args.weights_dir, musetalk_device=args.musetalk_device)
    folder = weights_dir(config)
    try:
        check_layout(folder)
    except WeightsError as exc:
        if args.engine == "musetalk":
            raise
        print(f"musetalk: skipped ({exc})")
        return 0
    models = load_models(folder, resolve_placement(args.musetalk_device))
    out = args.out or default_cache_dir() / "musetalk-avatars"
    material = prepare_musetalk_avatar(
        args.source,
        models.encode_crops,
        encoder_id=weights_id(folder),
        cache_dir=out,
        bbox_shift=args.bbox_shift,
        extra_margin=args.extra_margin,
        progress=True,
    )
    state = "cache hit" if material.cache_hit else "prepared"
    print(
        f"musetalk: {args.source}: {state}, {material.source_frames} source frames, "
        f"idle loop of {len(material)}; cached in {out}"
    )
    return 0


def _download_weights(args: argparse.Namespace) -> int:
    from musetalk_core.weights import DEFAULT_WEIGHTS_DIR, WeightsError, download_weights
    from musetalk_core.weights import verify_weights as verify

    folder = args.dir or DEFAULT_WEIGHTS_DIR
    if args.verify:
        problems = verify(folder)
        for problem in problems:
            print(f"avatar-rtc: {problem}", file=sys.stderr)
        print(f"{folder}: {'sound' if not problems else 'NOT sound'}")
        return 1 if problems else 0
    try:
        download_weights(folder)
    except WeightsError as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # no network, a full disk
        print(f"avatar-rtc: error: download failed: {exc}", file=sys.stderr)
        return 1
    print(f"MuseTalk weights in {folder}, checked; serve with --weights-dir {folder}")
    return 0


def _token(args: argparse.Namespace) -> int:
    from signaling.access import MAX_TTL_S, TokenSigner

    if not args.api_key:
        print("avatar-rtc: error: give --api-key or AVATAR_RTC_API_KEY", file=sys.stderr)
        return 2
    if not 1 <= args.ttl_s <= MAX_TTL_S:
        print(f"avatar-rtc: error: --ttl-s must be 1..{MAX_TTL_S}", file=sys.stderr)
        return 2
    print(TokenSigner(args.api_key).mint(ttl_s=args.ttl_s, avatar=args.avatar))
    return 0


def _doctor() -> int:
    import aiortc
    import av

    from rtc_server.engines import load_engine_factory, musetalk_choice

    print(f"python {sys.version.split()[0]}, aiortc {aiortc.__version__}, av {av.__version__}")
    has_x264 = "libx264" in av.codecs_available
    print("H.264 encoder (libx264):", "yes" if has_x264 else "NO: VP8 only")
    from rtc_server.providers.registry import choose

    config = ServerConfig(
        weights_dir=Path(os.environ["AVATAR_RTC_WEIGHTS_DIR"])
        if os.environ.get("AVATAR_RTC_WEIGHTS_DIR")
        else None,
        openai_api_key=os.environ.get("OPENAI_API_KEY") or None,
        openai_base_url=os.environ.get("OPENAI_BASE_URL") or None,
        elevenlabs_api_key=os.environ.get("ELEVENLABS_API_KEY") or None,
    )
    use_musetalk, reason = musetalk_choice(config)
    if use_musetalk:  # say so without loading a GPU model just to print a line
        print(f"lip-sync engine: musetalk ({reason})")
    else:
        factory = load_engine_factory(config)
        print(f"lip-sync engine: {factory.name} ({factory.reason})")
    for choice in choose(config):
        print(f"{choice.slot}: {choice.name} ({choice.reason})")
    return 0


def configure_logging(verbose: int) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if verbose < 2:
        for noisy in ("aioice", "aiortc", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        parser = build_parser(environ)
    except EnvError as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    if args.command == "serve":
        return _serve(args, environ)
    if args.command == "prepare-avatar":
        return _prepare(args)
    if args.command == "download-weights":
        return _download_weights(args)
    if args.command == "doctor":
        return _doctor()
    if args.command == "token":
        return _token(args)
    if args.command == "bench":
        from benchmarks.cli import main as bench_main

        code: int = bench_main(args.args)
        return code
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
