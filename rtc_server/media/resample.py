"""Exact rational resampling of mono int16 PCM (polyphase FIR, scipy)."""

from __future__ import annotations

from math import gcd

import numpy as np
from scipy.signal import firwin, resample_poly


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


class StreamResampler:
    """One stream's resampler: pieces in, the samples :func:`resample_int16` would give for the
    whole stream out, as soon as they are known; :meth:`flush` at the stream's end.

    Resampling each network chunk on its own filters every chunk edge against silence: a click
    at each join, and a length rounded per chunk (22.05 kHz in 25 ms chunks drifts 16 samples a
    second). This is the same polyphase filter as ``scipy.signal.resample_poly`` (its Kaiser
    windowed sinc, 10 zero crossings a side, output aligned the same way), run over the stream
    with its history kept: an output sample is made once every input sample it needs has come,
    about 10 input samples later; the end is zero-padded, as the whole-signal call pads it.
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        if src_rate <= 0 or dst_rate <= 0:
            raise ValueError(f"sample rates must be positive: {src_rate} -> {dst_rate}")
        g = gcd(src_rate, dst_rate)
        self.src_rate, self.dst_rate = src_rate, dst_rate
        self._up, self._down = dst_rate // g, src_rate // g
        up, down = self._up, self._down
        self._received = 0
        self._made = 0
        if up == down:
            return  # the same rate: samples pass as they are
        max_rate = max(up, down)
        half_len = 10 * max_rate
        taps = firwin(2 * half_len + 1, 1.0 / max_rate, window=("kaiser", 5.0)) * up
        pre = down - half_len % down
        self._h = np.concatenate([np.zeros(pre), taps])
        self._skip = (half_len + pre) // down
        """Outputs of the full convolution before the first one kept (the filter's delay)."""
        self._per_output = -(-len(self._h) // up) + 1
        self._held = np.zeros(0, np.float64)
        self._held_from = 0
        """The input index of ``_held[0]``."""

    @property
    def behind_s(self) -> float:
        """How far the output lags the input now: what the next output sample starts late by,
        against the next input sample (seconds; about 10 input samples, 0 at the same rate)."""
        return self._received / self.src_rate - self._made / self.dst_rate

    def feed(self, pcm: np.ndarray) -> np.ndarray:
        """The output samples ``pcm`` (the next piece of the stream) completes; int16."""
        if self._up == self._down:
            self._received += len(pcm)
            self._made += len(pcm)
            return np.asarray(pcm).astype(np.int16, copy=False)
        self._held = np.concatenate([self._held, np.asarray(pcm, np.float64).reshape(-1)])
        self._received += len(pcm)
        # Output m needs inputs up to ((m + skip) * down) // up.
        ready = (self._received * self._up - 1) // self._down - self._skip + 1
        return self._make(max(self._made, ready))

    def flush(self) -> np.ndarray:
        """The stream ended: the rest of its output (its tail filtered against silence)."""
        if self._up == self._down:
            return np.zeros(0, np.int16)
        total = -(-self._received * self._up // self._down)
        return self._make(total)

    def _make(self, until: int) -> np.ndarray:
        m = np.arange(self._made, until, dtype=np.int64)
        if not len(m):
            return np.zeros(0, np.int16)
        up, down = self._up, self._down
        at = (m + self._skip) * down  # position in the upsampled stream
        newest = at // up
        inputs = newest[:, None] - np.arange(self._per_output)[None, :]
        tap = at[:, None] - inputs * up
        valid = (tap < len(self._h)) & (inputs >= 0) & (inputs < self._received)
        local = np.clip(inputs - self._held_from, 0, max(0, len(self._held) - 1))
        values = self._held[local] if len(self._held) else np.zeros(inputs.shape)
        out = np.where(valid, values * self._h[np.minimum(tap, len(self._h) - 1)], 0.0).sum(axis=1)
        self._made = until
        # Keep what the next output still needs.
        oldest = int(((until + self._skip) * down) // up) - self._per_output + 1
        drop = max(0, oldest - self._held_from)
        if drop:
            self._held = self._held[drop:]
            self._held_from += drop
        result: np.ndarray = np.clip(np.round(out), -32768, 32767).astype(np.int16)
        return result
