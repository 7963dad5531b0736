"""Exact rational resampling of mono int16 PCM (polyphase FIR, scipy)."""

from __future__ import annotations

from math import gcd

import numpy as np
from scipy.signal import resample_poly


def resample_int16(pcm: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample ``pcm`` from ``src_rate`` to ``dst_rate``; the length scales exactly by the ratio.

    A wrong ratio is silent and deadly (Whisper turns half-speed audio into fluent nonsense), so
    the factors are derived from the two rates, never written by hand.
    """
    if src_rate == dst_rate:
        return pcm.astype(np.int16, copy=False)
    g = gcd(src_rate, dst_rate)
    up, down = dst_rate // g, src_rate // g
    out = resample_poly(pcm.astype(np.float32), up, down)
    result: np.ndarray = np.clip(np.round(out), -32768, 32767).astype(np.int16)
    return result
