"""One error tree: every exception class of ours descends from AvatarRtcError."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from musetalk_core.types import AvatarRtcError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rtc_server", "signaling", "musetalk_core", "benchmarks")


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
            if not any(n.endswith(("Error", "Exception", "Stalled")) for n in names):
                continue
            module = importlib.import_module(
                ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            )
            for name in names:
                value = getattr(module, name)
                if isinstance(value, type) and issubclass(value, BaseException):
                    found.append(value)
    return found


def test_every_exception_of_ours_is_an_avatar_rtc_error() -> None:
    classes = _exception_classes()
    names = {c.__name__ for c in classes}
    # The tree of docs/ARCHITECTURE.md, "Errors", as found in the code.
    assert {
        "AvatarRtcError",
        "ConfigError",
        "EnvError",
        "AvatarError",
        "NoFaceError",
        "WeightsError",
        "EngineError",
        "EngineStalled",
        "ProviderError",
        "HTTPStatusError",
        "SignalingError",
    } <= names
    outside = [c.__qualname__ for c in classes if not issubclass(c, AvatarRtcError)]
    assert outside == [], f"exceptions outside the tree: {outside}"


def test_the_tree_keeps_the_builtin_kinds_callers_catch() -> None:
    from musetalk_core.types import EngineError
    from musetalk_core.warp_avatar import AvatarError
    from musetalk_core.weights import WeightsError
    from rtc_server.config import ConfigError, ServerConfig
    from rtc_server.options import EnvError

    assert issubclass(ConfigError, ValueError) and issubclass(EnvError, ConfigError)
    assert issubclass(AvatarError, ValueError)
    assert issubclass(WeightsError, RuntimeError) and issubclass(EngineError, RuntimeError)
    try:
        ServerConfig.of(port=0)
    except ConfigError as exc:
        assert "port must be 1..65535" in str(exc)
    else:
        raise AssertionError("port 0 was accepted")
