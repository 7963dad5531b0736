"""The command line: flags, environment variables, clear errors for bad input."""

from __future__ import annotations

import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from rtc_server.cli import build_parser, main
from rtc_server.config import ServerConfig
from rtc_server.providers.registry import choose


def test_env_vars_fill_flags_and_flags_win() -> None:
    env = {
        "AVATAR_RTC_PORT": "9001",
        "AVATAR_RTC_ICE_ADDRESS": "127.0.0.1",
        "AVATAR_RTC_LLM": "echo",
    }
    args = build_parser(env).parse_args(["serve"])
    assert args.port == 9001 and args.llm == "echo"
    args = build_parser(env).parse_args(["serve", "--port", "9002"])
    assert args.port == 9002


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("", False),
    ],
)
def test_switches_from_the_environment_mean_what_they_say(value: str, on: bool) -> None:
    env = {
        "AVATAR_RTC_MUSETALK_COMPILE": value,
        "AVATAR_RTC_NO_BARGE_IN": value,
        "AVATAR_RTC_NO_HEADROOM": value,
    }
    args = build_parser(env).parse_args(["serve"])
    assert (args.musetalk_compile, args.no_barge_in, args.no_headroom) == (on, on, on)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("AVATAR_RTC_PORT", "abc", "not a whole number"),
        ("AVATAR_RTC_CPU_LIMIT", "lots", "not a number"),
        ("AVATAR_RTC_NO_BARGE_IN", "maybe", "use 1/true/yes/on or 0/false/no/off"),
    ],
)
def test_a_bad_environment_value_is_a_clear_error(
    name: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve"], {name: value}) == 2
    err = capsys.readouterr().err
    assert f"{name}={value!r}" in err and says in err and "Traceback" not in err


def test_prepare_avatar_finds_the_face(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from skimage import data

    portrait = tmp_path / "me.png"
    cv2.imwrite(str(portrait), cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR))
    assert main(["prepare-avatar", str(portrait), "--out", str(tmp_path / "cache")], {}) == 0
    assert "mouth at" in capsys.readouterr().out
    assert list((tmp_path / "cache").glob("*.npz"))


@pytest.mark.parametrize("command", ["prepare-avatar", "serve"])
def test_a_portrait_without_a_face_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    blank = tmp_path / "wall.png"
    cv2.imwrite(str(blank), np.full((256, 256, 3), 200, np.uint8))
    argv = (
        [command, str(blank)]
        if command == "prepare-avatar"
        else ["serve", "--avatar", str(blank), "--cache-dir", str(tmp_path)]
    )
    assert main(argv, {}) == 2
    err = capsys.readouterr().err
    assert "no frontal face" in err


def test_missing_portrait_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare-avatar", str(tmp_path / "nope.jpg")], {}) == 2
    assert "error" in capsys.readouterr().err


def test_bad_values_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "--max-sessions", "0", "--cache-dir", str(tmp_path)], {}) == 2
    assert "max_sessions" in capsys.readouterr().err
    assert main(["serve", "--tts", "elevenlabs", "--cache-dir", str(tmp_path)], {}) == 2
    assert "API key" in capsys.readouterr().err


def test_auto_picks_cloud_only_with_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    offline = [c.name for c in choose(ServerConfig.of())]
    assert offline == ["local", "local", "piper"]  # the local LLM: `make install` installs it
    # Where the local model's server is not installed, echo answers and the choice says why.
    monkeypatch.setattr("rtc_server.local_llm.find_binary", lambda: None)
    llm = choose(ServerConfig.of())[1]
    assert llm.name == "echo" and "llama-server is not installed" in llm.reason, llm
    monkeypatch.undo()
    both = ServerConfig.of(openai_api_key="k", elevenlabs_api_key="x")
    assert [c.name for c in choose(both)] == ["openai", "openai", "elevenlabs"]
    assert all(c.reason.startswith("auto:") for c in choose(both))
    local_llm = ServerConfig.of(openai_base_url="http://127.0.0.1:11434/v1")
    assert [c.name for c in choose(local_llm)] == ["local", "openai", "piper"]
    asked = ServerConfig.of(openai_api_key="k", stt="local", tts="piper")
    assert [(c.name, c.reason) for c in choose(asked)][0] == ("local", "asked for")


def test_token_command_mints_what_the_server_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    from signaling.access import TokenSigner

    key = "cli-test-api-key-0123456789abcdefgh"
    env = {"AVATAR_RTC_API_KEY": key}
    assert main(["token", "--ttl-s", "60"], env) == 0
    token = capsys.readouterr().out.strip()
    grant = TokenSigner(key).verify(token)
    assert grant.avatar is None and 0 < grant.expires_at - time.time() <= 60
    assert main(["token"], {}) == 2
    assert "AVATAR_RTC_API_KEY" in capsys.readouterr().err
    assert main(["token", "--ttl-s", "0"], env) == 2


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from musetalk_core.tiny import build_random_weights

    return build_random_weights(tmp_path_factory.mktemp("weights"))


def test_prepare_avatar_for_musetalk_is_cached(
    tiny_weights: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skimage import data

    portrait = tmp_path / "me.png"
    cv2.imwrite(str(portrait), cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR))
    argv = ["prepare-avatar", str(portrait), "--out", str(tmp_path / "cache")]
    argv += ["--engine", "musetalk", "--weights-dir", str(tiny_weights)]
    argv += ["--musetalk-device", "cpu"]
    assert main(argv, {}) == 0
    out = capsys.readouterr().out
    assert "musetalk:" in out and "prepared, 1 source frames" in out
    assert main(argv, {}) == 0
    assert "cache hit" in capsys.readouterr().out
    # Without weights: a clear error for --engine musetalk, a note for auto.
    argv[argv.index(str(tiny_weights))] = str(tmp_path / "none")
    assert main(argv, {}) == 2
    assert "no MuseTalk weights directory" in capsys.readouterr().err
    argv[argv.index("musetalk")] = "auto"
    assert main(argv, {}) == 0
    assert "musetalk: skipped" in capsys.readouterr().out


def test_download_weights_verify(
    tiny_weights: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    assert main(["download-weights", "--dir", str(tiny_weights), "--verify"], {}) == 0
    assert "sound" in capsys.readouterr().out
    copy = tmp_path / "w"
    shutil.copytree(tiny_weights, copy)
    config = copy / "whisper" / "config.json"
    config.write_text(config.read_text().replace('"d_model": 384', '"d_model": 385'))
    assert main(["download-weights", "--dir", str(copy), "--verify"], {}) == 1
    assert "whisper/config.json: SHA-256 differs" in capsys.readouterr().err


def test_doctor_says_which_engine_and_why(
    tiny_weights: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    monkeypatch.setenv("AVATAR_RTC_WEIGHTS_DIR", str(tiny_weights))
    monkeypatch.delenv("AVATAR_RTC_LLM", raising=False)  # tests/conftest.py asks for echo
    for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ELEVENLABS_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    assert main(["doctor"], {}) == 0
    out = capsys.readouterr().out
    # Which LLM answers and why, its weights checked as at start-up.
    assert (
        "llm: local (auto: no cloud key in the environment, offline default): "
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0)"
    ) in out, out
    assert "sha256 checked" in out
    if torch.cuda.is_available():
        assert "lip-sync engine: musetalk (auto: CUDA and MuseTalk weights" in out
    else:
        assert "lip-sync engine: warp (auto: no CUDA device" in out


def test_the_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    import rtc_server

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert rtc_server.__version__ == project["project"]["version"]
    with pytest.raises(SystemExit) as exit_:
        main(["--version"], {})
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"avatar-rtc {rtc_server.__version__}"
    changelog = (Path(__file__).parents[1] / "CHANGELOG.md").read_text()
    assert f"## {rtc_server.__version__} (" in changelog


def test_bench_takes_its_own_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    # ``--help`` straight after ``bench`` is the benchmarks' help, not an unknown argument of
    # the top level; a value that happens to read "bench" is not the bench command.
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: avatar-rtc bench") and "load" in out and "synthesis" in out
    with pytest.raises(SystemExit) as stop:
        main(["-v", "bench", "load", "--help"])
    assert stop.value.code == 0
    assert "--providers" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--system-prompt", "bench", "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: avatar-rtc serve")
