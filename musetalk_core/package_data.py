"""Model files that ship inside other packages, found without importing those packages.

Importing them would run their ``__init__``: TensorFlow for the face models' package, torch
(and a process-wide thread count) for Silero's, a whole voice-agent framework for Smart Turn's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(name: str) -> Path | None:
    """The folder of the installed package ``name`` (None when it is not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))
