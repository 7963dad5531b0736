"""The options table drives argparse, the environment and the README, and they agree."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from rtc_server.cli import build_parser, main
from rtc_server.config import SECTIONS, ConfigError, EngineSettings, ServerConfig
from rtc_server.options import (
    GROUPS,
    SERVE_OPTIONS,
    EnvError,
    Kind,
    Option,
    config_from,
    env_default,
    markdown,
)

ROOT = Path(__file__).resolve().parents[1]


def _serve_actions() -> dict[str, argparse.Action]:
    parser = build_parser({})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return {
        o.removeprefix("--"): a
        for a in serve._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }


def test_every_serve_flag_is_in_the_table_and_the_table_is_every_flag() -> None:
    actions = _serve_actions()
    # A key's flag names its file; the key's own flag is there to refuse it (see below).
    assert set(actions) == {o.flag for o in SERVE_OPTIONS} | {o.cli_flag for o in SERVE_OPTIONS}
    for o in SERVE_OPTIONS:
        action = actions[o.cli_flag]
        assert o.env in (action.help or ""), o.flag  # the help names its variable
        if o.kind is Kind.VALUE and not o.secret:
            assert action.default == o.default and action.choices == o.choices, o.flag


def test_the_readme_shows_the_table() -> None:
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"<!-- options:start -->\n(.*?)<!-- options:end -->", readme, re.S)
    assert section, "README.md lost its generated options section"
    assert section.group(1) == markdown(), "run: python -m rtc_server.options"


def test_defaults_make_the_default_config() -> None:
    config = config_from(build_parser({}).parse_args(["serve"]), {})
    assert config == ServerConfig.of()


def test_every_option_fills_a_field_of_its_groups_section_or_says_it_does_not() -> None:
    assert list(GROUPS) == list(SECTIONS)  # the README's groups are the config's sections
    for o in SERVE_OPTIONS:
        if o.in_config:
            fields = {f.name for f in dataclasses.fields(SECTIONS[o.group])}
            assert (o.field or o.dest) in fields, o.flag


def test_the_config_is_frozen_and_changed_only_by_a_validated_copy() -> None:
    config = ServerConfig.of(port=9000, barge_in=False, engine=EngineSettings(name="warp"))
    assert (config.server.port, config.conversation.barge_in) == (9000, False)
    assert config.engine.name == "warp" and config.engine.musetalk_batch == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1  # type: ignore[misc]
    changed = config.replace(port=9001, rate_limit_per_min=0)
    assert (changed.server.port, changed.access.rate_limit_per_min) == (9001, 0)
    assert changed.engine is config.engine and config.server.port == 9000
    with pytest.raises(ValueError, match="port must be"):
        config.replace(port=0)
    with pytest.raises(TypeError, match="no field 'prot'"):
        ServerConfig.of(prot=1)


NUMBERS = [o for o in SERVE_OPTIONS if o.type in (int, float)]


@pytest.mark.parametrize("o", NUMBERS, ids=[o.flag for o in NUMBERS])
def test_a_number_option_refuses_what_is_not_a_number(o: Option) -> None:
    with pytest.raises(EnvError, match=re.escape(f"{o.env}='ten'")):
        env_default(o, {o.env: "ten"})
    assert env_default(o, {o.env: " 7 "}) == 7


def test_values_from_the_environment_reach_the_config_and_flags_win() -> None:
    env = {
        "AVATAR_RTC_PORT": "9001",
        "AVATAR_RTC_NO_BARGE_IN": "yes",
        "AVATAR_RTC_ICE_ADDRESS": "127.0.0.1, ::1",
        "AVATAR_RTC_ENGINE": "warp",
        "AVATAR_RTC_CPU_LIMIT": "0",
        "AVATAR_RTC_API_KEY": "",
    }
    config = config_from(build_parser(env).parse_args(["serve"]), env)
    assert (config.server.port, config.conversation.barge_in, config.engine.name) == (
        9001,
        False,
        "warp",
    )
    assert config.media.ice_addresses == ("127.0.0.1", "::1")
    assert config.server.cpu_limit is None and config.access.api_key is None  # 0 and empty: unset
    args = build_parser(env).parse_args(["serve", "--ice-address", "127.0.0.2", "--port", "5"])
    config = config_from(args, env)
    assert config.media.ice_addresses == ("127.0.0.2",) and config.server.port == 5


def test_a_choice_outside_its_choices_names_the_variable() -> None:
    with pytest.raises(EnvError, match="AVATAR_RTC_ENGINE='gpu'.*auto, musetalk, warp"):
        build_parser({"AVATAR_RTC_ENGINE": "gpu"})


# -- secrets ----------------------------------------------------------------------------------

STRONG = "0f4c2a9e7b3d5a1c8e6f0b2d4a6c8e0f"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--api-key", STRONG],
        ["serve", "--turn-secret", STRONG, "--turn-url", "turn:127.0.0.1:3478"],
        ["token", "--api-key", STRONG],
    ],
    ids=["serve api key", "serve turn secret", "token"],
)
def test_keys_never_come_from_the_command_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv, {})
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    flag = argv[1]
    assert f"{flag}-file" in error and f"AVATAR_RTC_{flag[2:].upper().replace('-', '_')}" in error
    assert STRONG not in error


def _config(argv: list[str], env: dict[str, str]) -> ServerConfig:
    return config_from(build_parser(env).parse_args(["serve", *argv]), env)


def test_keys_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(STRONG + "\n")
    assert _config(["--api-key-file", str(key_file)], {}).access.api_key == STRONG
    env = {"AVATAR_RTC_API_KEY_FILE": str(key_file)}
    assert _config([], env).access.api_key == STRONG
    assert _config([], {"AVATAR_RTC_API_KEY": STRONG}).access.api_key == STRONG
    with pytest.raises(ConfigError, match="both set"):
        _config(["--api-key-file", str(key_file)], {"AVATAR_RTC_API_KEY": STRONG})
    with pytest.raises(ConfigError, match="cannot read it"):
        _config(["--api-key-file", str(tmp_path / "missing")], {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        _config(["--api-key-file", str(tmp_path / "empty")], {})
    secret_file = tmp_path / "turn-secret"
    secret_file.write_text(STRONG)
    turn = ["--turn-secret-file", str(secret_file), "--turn-url", "turn:127.0.0.1:3478"]
    config = _config([*turn, "--api-key-file", str(key_file)], {})
    assert config.media.turn_secret == STRONG


def _example_secrets() -> list[str]:
    text = (ROOT / "deploy" / "k8s" / "secret.example.yaml").read_text()
    values = re.findall(r"^\s+[\w-]+: (\S+)$", text.split("stringData:")[1], re.M)
    conf = (ROOT / "deploy" / "turnserver.conf").read_text()
    values += re.findall(r"^static-auth-secret=(\S+)$", conf, re.M)
    assert values
    return values


@pytest.mark.parametrize(
    "key",
    [
        "short-key",
        "a" * 64,
        "abab" * 10,
        "replace-me-with-a-long-random-value-0123",
        "CHANGEME-0123456789abcdefghijklmnop",
        *_example_secrets(),
    ],
)
def test_weak_and_placeholder_keys_stop_start_up(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = ["--cache-dir", str(tmp_path)]
    assert main(["serve", *cache], {"AVATAR_RTC_API_KEY": key}) == 2
    error = capsys.readouterr().err
    assert "API key" in error and "openssl rand -hex 32" in error and key not in error
    turn = ["serve", "--turn-url", "turn:127.0.0.1:3478", *cache]
    env = {"AVATAR_RTC_TURN_SECRET": key, "AVATAR_RTC_API_KEY": STRONG}
    assert main(turn, env) == 2
    assert "TURN secret" in capsys.readouterr().err
