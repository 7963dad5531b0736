"""The VAE's attention parameter names: as ``stabilityai/sd-vae-ft-mse`` is published, and as
diffusers' ``AutoencoderKL`` names them now.

The release predates diffusers' attention rewrite: its mid-block attention is stored as
``query``, ``key``, ``value`` and ``proj_attn``; the model now has ``to_q``, ``to_k``,
``to_v`` and ``to_out.0`` (the same tensors, renamed; ``group_norm`` kept its name). diffusers'
``from_pretrained`` renames them on load; the loader here reads the file itself (safetensors
or a ``weights_only`` torch load) and renames them the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

T = TypeVar("T")

PUBLISHED_TO_MODERN = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def _split(key: str) -> tuple[str, str, str] | None:
    """``a.b.attentions.0.query.weight`` -> (``a.b.attentions.0``, ``query``, ``weight``)."""
    parts = key.rsplit(".", 1)
    if len(parts) != 2:
        return None
    prefix, leaf = parts
    for published, modern in PUBLISHED_TO_MODERN.items():
        for name in (published, modern):
            if prefix.endswith("." + name):
                return prefix[: -len(name) - 1], name, leaf
    return None


def modern_keys(state: Mapping[str, T], expected: Collection[str]) -> dict[str, T]:
    """``state`` with each published attention name the model does not know renamed to the
    one it does; every other key (modern files included) as it is, for a strict load to judge."""
    renamed: dict[str, T] = {}
    for key, value in state.items():
        split = _split(key) if key not in expected else None
        if split is not None and split[1] in PUBLISHED_TO_MODERN:
            path, name, leaf = split
            candidate = f"{path}.{PUBLISHED_TO_MODERN[name]}.{leaf}"
            if candidate in expected:
                key = candidate
        renamed[key] = value
    return renamed


def published_keys(state: Mapping[str, T]) -> dict[str, T]:
    """A modern state dict in the published names (for the test release, written as the real
    one is)."""
    modern_to_published = {m: p for p, m in PUBLISHED_TO_MODERN.items()}
    renamed: dict[str, T] = {}
    for key, value in state.items():
        split = _split(key)
        if split is not None and ".attentions." in key and split[1] in modern_to_published:
            path, name, leaf = split
            key = f"{path}.{modern_to_published[name]}.{leaf}"
        renamed[key] = value
    return renamed
