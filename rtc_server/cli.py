"""``avatar-rtc``: serve, prepare-avatar, download-weights, doctor, token, bench.

Every ``serve`` flag can also come from the environment as ``AVATAR_RTC_<FLAG>`` (dashes as
underscores; repeatable flags take a comma-separated list); a flag given on the command line
wins. The options are declared once, in ``rtc_server/options.py``.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rtc_server import __version__
from rtc_server.config import ConfigError, ServerConfig, default_cache_dir
from rtc_server.cpu_priority import cores
from rtc_server.logs import configure_logging
from rtc_server.options import (
    SERVE_OPTIONS,
    EnvError,
    add_options,
    add_secret_argument,
    config_from,
    env_default,
    option,
    secret_from,
)

if TYPE_CHECKING:
    from rtc_server.engine_factory import EngineFactory
    from rtc_server.providers.registry import Choice


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="avatar-rtc", description=__doc__, formatter_class=fmt)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--version", action="version", version=f"avatar-rtc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="serve the call page and WebRTC API",
        description="Every option can also be set as its environment variable (in brackets).",
        formatter_class=fmt,
    )
    add_options(serve, environ, SERVE_OPTIONS)

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
    add_options(
        prep, environ, [option("weights-dir"), option("musetalk-device"), option("framing")]
    )
    prep.add_argument(
        "--bbox-shift", type=int, default=0, help="MuseTalk: move the half-face line down (px)"
    )
    prep.add_argument("--extra-margin", type=int, default=10, help="MuseTalk: pixels below chin")

    weights = sub.add_parser(
        "download-weights", help="fetch MuseTalk 1.5 weights and check them", formatter_class=fmt
    )
    weights.add_argument("--dir", type=Path, default=env_default(option("weights-dir"), environ))
    weights.add_argument(
        "--verify", action="store_true", help="only rehash what is there against the manifest"
    )

    sub.add_parser("doctor", help="say which engine, providers and codecs would be used, and why")

    tok = sub.add_parser("token", help="mint a call token for a server with an API key")
    add_secret_argument(tok, option("api-key"), environ)
    tok.add_argument("--ttl-s", type=int, default=300)

    bench = sub.add_parser("bench", help="benchmarks (see benchmarks/README.md)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    try:
        config = config_from(args, environ)
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


def prepare(config: ServerConfig) -> EngineFactory:
    """What a server checks before serving: the ICE servers, the end-of-turn model asked for,
    the portrait (the engine factory).

    Raises ValueError or ``musetalk_core.warp_avatar.AvatarError`` with a message for the user.
    """
    from rtc_server.engine_factory import load_engine_factory
    from rtc_server.ice import IceServers

    IceServers.from_config(config.media.ice_servers)  # a malformed --ice-server stops here
    if config.conversation.end_of_turn == "smart-turn":
        from rtc_server.end_of_turn import smart_turn_model_path

        try:
            smart_turn_model_path()  # asked for and not installed: stop with the reason
        except RuntimeError as exc:
            raise ValueError(f"--end-of-turn smart-turn: {exc}") from exc
    # Prepared here, before serving, so a bad portrait stops start-up with its reason.
    return load_engine_factory(config)


def _serve_alone(config: ServerConfig) -> int:
    import asyncio

    from musetalk_core.warp_avatar import AvatarError
    from rtc_server.app import create_app
    from rtc_server.serving import serve

    try:
        factory = prepare(config)
    except (ValueError, AvatarError) as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    ssl_context = server_ssl_context(config)
    quiet_telemetry()
    app = create_app(config, engine_loader=lambda: factory, owns_process=True)
    scheme = "https" if ssl_context else "http"
    url = f"{scheme}://{config.server.host}:{config.server.port}"
    # SIGTERM drains: no new calls, running ones go on up to --drain-timeout-s, then exit 0.
    asyncio.run(
        serve(
            app,
            host=config.server.host,
            port=config.server.port,
            drain_timeout_s=config.server.drain_timeout_s,
            ssl_context=ssl_context,
            on_started=lambda: print(f"avatar-rtc: serving on {url}", flush=True),
        )
    )
    return 0


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.server.cert_file is None or config.server.key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.server.cert_file, config.server.key_file)
    return context


def quiet_telemetry() -> None:
    # onnxruntime (Piper) otherwise looks up a telemetry host: offline means nothing leaves.
    try:
        import onnxruntime

        onnxruntime.disable_telemetry_events()
    except (ImportError, AttributeError):
        pass


def _prepare(args: argparse.Namespace) -> int:
    from musetalk_core.warp_avatar import AvatarError, load_portrait, prepare_avatar
    from musetalk_core.weights import WeightsError

    out = args.out or default_cache_dir() / "avatars"
    try:
        avatar = prepare_avatar(load_portrait(args.source), cache_dir=out, framing=args.framing)
        x, y, w, h = avatar.mouth_box
        print(f"warp: {args.source}: mouth at x={x} y={y} w={w} h={h}; cached in {out}")
        if args.engine != "warp":
            return _prepare_musetalk(args)
    except (AvatarError, WeightsError) as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _prepare_musetalk(args: argparse.Namespace) -> int:
    from musetalk_core.loading import load_musetalk
    from musetalk_core.weights import WeightsError, check_layout
    from rtc_server.engine_factory import weights_dir

    config = ServerConfig.of(weights_dir=args.weights_dir, musetalk_device=args.musetalk_device)
    folder = weights_dir(config)
    try:
        check_layout(folder)
    except WeightsError as exc:
        if args.engine == "musetalk":
            raise
        print(f"musetalk: skipped ({exc})")
        return 0
    out = args.out or default_cache_dir() / "musetalk-avatars"
    material = load_musetalk(
        folder,
        args.source,
        cache_dir=out,
        device=args.musetalk_device,
        bbox_shift=args.bbox_shift,
        extra_margin=args.extra_margin,
        framing=args.framing,
        progress=True,
    ).material
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


def _token(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from signaling.access import MAX_TTL_S, TokenSigner

    try:
        key = secret_from(option("api-key"), args.api_key_file, environ)
    except ConfigError as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    if not key:
        print("avatar-rtc: error: set AVATAR_RTC_API_KEY or give --api-key-file", file=sys.stderr)
        return 2
    if not 1 <= args.ttl_s <= MAX_TTL_S:
        print(f"avatar-rtc: error: --ttl-s must be 1..{MAX_TTL_S}", file=sys.stderr)
        return 2
    print(TokenSigner(key).mint(ttl_s=args.ttl_s))
    return 0


def _doctor_config() -> ServerConfig:
    """What ``serve`` would be configured with, as far as ``doctor`` needs it."""
    return ServerConfig.of(
        weights_dir=Path(os.environ["AVATAR_RTC_WEIGHTS_DIR"])
        if os.environ.get("AVATAR_RTC_WEIGHTS_DIR")
        else None,
        openai_api_key=os.environ.get("OPENAI_API_KEY") or None,
        openai_base_url=os.environ.get("OPENAI_BASE_URL") or None,
        elevenlabs_api_key=os.environ.get("ELEVENLABS_API_KEY") or None,
        llm=os.environ.get("AVATAR_RTC_LLM") or "auto",
        **(
            {"cache_dir": Path(os.environ["AVATAR_RTC_CACHE_DIR"])}
            if os.environ.get("AVATAR_RTC_CACHE_DIR")
            else {}
        ),
    )


def _doctor() -> int:
    import aiortc
    import av

    from rtc_server.engine_factory import load_engine_factory, musetalk_choice

    print(f"python {sys.version.split()[0]}, aiortc {aiortc.__version__}, av {av.__version__}")
    has_x264 = "libx264" in av.codecs_available
    print("H.264 encoder (libx264):", "yes" if has_x264 else "NO: VP8 only")
    from rtc_server.providers.registry import choose

    try:
        config = _doctor_config()
    except ConfigError as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    use_musetalk, reason = musetalk_choice(config)
    if use_musetalk:  # say so without loading a GPU model just to print a line
        print(f"lip-sync engine: musetalk ({reason})")
    else:
        factory = load_engine_factory(config)
        print(f"lip-sync engine: {factory.name} ({factory.reason})")
    for choice in choose(config):
        print(_checked(choice, config))
    return 0


def _checked(choice: Choice, config: ServerConfig) -> str:
    """``doctor``'s line for one provider: the local model's weights are hashed as at
    start-up, and a refusal shows the fallback and why."""
    if choice.slot == "llm" and choice.name == "local":
        from rtc_server.local_llm.weights import WeightsRefused, model_status
        from rtc_server.providers.registry import refused_local_llm

        try:
            model = model_status(config.server.cache_dir)
        except WeightsRefused as exc:
            choice = refused_local_llm(choice, str(exc))
        else:
            return f"llm: local ({choice.reason}): {model}"
    return f"{choice.slot}: {choice.name} ({choice.reason})"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        parser = build_parser(environ)
    except EnvError as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word that is not an option (the top level takes no values).
    at = next((i for i, word in enumerate(argv) if not word.startswith("-")), None)
    if at is not None and argv[at] == "bench":
        # Everything after ``bench`` is the benchmarks' own command line, ``--help`` first
        # included (argparse's remainder does not take an option as its first word).
        args = parser.parse_args([*argv[:at], "bench"])
        args.args = argv[at + 1 :]
    else:
        args = parser.parse_args(argv)
    configure_logging(args.verbose, getattr(args, "log_format", "text"))
    if args.command == "serve":
        return _serve(args, environ)
    if args.command == "prepare-avatar":
        return _prepare(args)
    if args.command == "download-weights":
        return _download_weights(args)
    if args.command == "doctor":
        return _doctor()
    if args.command == "token":
        return _token(args, environ)
    if args.command == "bench":
        from benchmarks.cli import main as bench_main

        code: int = bench_main(args.args)
        return code
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
