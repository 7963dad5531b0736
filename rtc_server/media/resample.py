"""Exact rational resampling of mono int16 PCM (polyphase FIR, scipy)."""

from __future__ import annotations

from math import gcd

import numpy as np
from scipy.signal import firwin, resample_poly, upfirdn


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
        """The output samples ``pcm`` (the next piece of the stream: int16, or floats on the
        int16 scale) completes; int16."""
        if self._up == self._down:
            self._received += len(pcm)
            self._made += len(pcm)
            same: np.ndarray = np.clip(np.round(pcm), -32768, 32767).astype(np.int16, copy=False)
            return same
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
        """Outputs ``_made`` to ``until``, from the held inputs (the rest of the stream zero)."""
        if until <= self._made:
            return np.zeros(0, np.int16)
        up, down = self._up, self._down
        # The held inputs start at a multiple of ``down``, so that upfirdn's outputs over them
        # fall on this stream's output instants: output m is its (m + skip - start) one.
        start = self._held_from * up // down
        y = upfirdn(self._h, self._held, up, down)
        first, last = self._made + self._skip - start, until + self._skip - start
        out = y[first:last]
        if len(out) < last - first:  # past every held input: the zeros after the stream
            out = np.concatenate([out, np.zeros(last - first - len(out))])
        self._made = until
        # Keep what the next output still needs, from a multiple of ``down``.
        oldest = ((until + self._skip) * down) // up - self._per_output + 1
        keep_from = max(self._held_from, oldest // down * down)
        if keep_from > self._held_from:
            self._held = self._held[keep_from - self._held_from :]
            self._held_from = keep_from
        result: np.ndarray = np.clip(np.round(out), -32768, 32767).astype(np.int16)
        return result
