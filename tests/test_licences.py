"""Nothing copyleft in the install, but what is named here and why.

Reads every installed distribution's declared licence (its SPDX expression, else its licence
classifiers, else a short ``License`` field: a long one is the licence's whole text, which
may mention the GPL without being it). ``make test``'s environment holds the default install
and the test tools, so a copyleft package coming in with either fails here.
"""

from __future__ import annotations

import importlib.metadata
import re

COPYLEFT = re.compile(r"\b(?:A|L)?GPL|General Public License", re.IGNORECASE)
KNOWN = {
    "piper-tts": "GPL-3.0-or-later since 1.3 (it carries espeak-ng): the bundled voice's "
    "runtime and phonemizer, in the install before this rule; to be replaced (issue 42)",
}
"""Copyleft packages the install still holds, each with the reason: the list only shrinks."""
SHORT_LICENCE = 100
"""Longer ``License`` fields hold the licence's text, not its name."""


def declared_licence(dist: importlib.metadata.Distribution) -> list[str]:
    meta = dist.metadata
    if expression := meta.get_all("License-Expression"):
        return [str(e) for e in expression]
    classifiers = [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return classifiers
    return [str(x) for x in meta.get_all("License") or [] if len(x) <= SHORT_LICENCE]


def copyleft(dist: importlib.metadata.Distribution) -> list[str]:
    """The copyleft licences ``dist`` declares."""
    return [d for d in declared_licence(dist) if COPYLEFT.search(d)]


def test_no_copyleft_package_is_installed_but_the_known_ones() -> None:
    found = {
        dist.metadata["Name"].lower(): copyleft(dist)
        for dist in importlib.metadata.distributions()
        if copyleft(dist)
    }
    assert set(found) <= set(KNOWN), {k: v for k, v in found.items() if k not in KNOWN}


def test_the_rule_reads_the_ways_a_licence_is_declared() -> None:
    def dist(**fields: str | list[str]) -> importlib.metadata.Distribution:
        lines = []
        for key, value in fields.items():
            for item in value if isinstance(value, list) else [value]:
                lines.append(f"{key.replace('_', '-')}: {item}")
        text = "\n".join(["Metadata-Version: 2.4", "Name: x", *lines]) + "\n"

        class Fake(importlib.metadata.Distribution):
            def read_text(self, filename: str) -> str | None:
                return text if filename in ("METADATA", "PKG-INFO") else None

            def locate_file(self, path: str) -> str:  # type: ignore[override]
                return path

        return Fake()

    def flagged(d: importlib.metadata.Distribution) -> bool:
        return bool(copyleft(d))

    gpl3 = "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"
    assert flagged(dist(License_Expression="GPL-3.0-or-later"))
    assert flagged(dist(License_Expression="AGPL-3.0-only"))
    assert flagged(dist(License_Expression="LGPL-2.1-or-later"))
    assert flagged(dist(Classifier=gpl3))
    assert flagged(dist(License="GPLv2"))
    assert not flagged(dist(License_Expression="MIT"))
    assert not flagged(dist(Classifier=["License :: OSI Approved :: BSD License"]))
    # A whole licence text that mentions the GPL (SciPy's bundled-library notices) is not one.
    assert not flagged(dist(License="Copyright (c) SciPy. " + "Compatible with the GPL. " * 10))
