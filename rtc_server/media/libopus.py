"""libopus itself, through ctypes: mono encoding and decoding without PyAV's frames around them.

Every call encodes its reply and decodes its caller's microphone 50 times a second. Through
PyAV each 20 ms frame also builds an ``AudioFrame``, runs a resampler graph (PyAV's frame-size
fitting) and, for the microphone, decodes stereo at 48 kHz only to be mixed to mono and brought
down to the 16 kHz the VAD hears. libopus decodes mono at 8, 12, 16, 24 or 48 kHz by itself.

The library is the one PyAV's wheel ships (so the version is PyAV's), else the system's
(Debian's ``libopus0``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from functools import cache

import av
import numpy as np

from musetalk_core.types import AvatarRtcError

__all__ = ["DECODE_RATES", "OpusError", "OpusMonoDecoder", "OpusMonoEncoder", "library"]

DECODE_RATES = (8_000, 12_000, 16_000, 24_000, 48_000)
"""The rates libopus decodes to (any Opus stream, whatever it was encoded at)."""
_APPLICATION_VOIP = 2048
_SET_BITRATE = 4002
_SET_COMPLEXITY = 4010
_SET_VBR_CONSTRAINT = 4020
_MAX_PACKET = 1500
_MAX_FRAME_S = 0.12
"""The longest Opus packet (120 ms)."""


class OpusError(AvatarRtcError, RuntimeError):
    """libopus refused: a bad packet, a bad setting, or no libopus at all."""


@cache
def library() -> ctypes.CDLL:
    """libopus, loaded once: PyAV's own copy, else the system's."""
    here = os.path.dirname(os.path.dirname(av.__file__))
    candidates = sorted(glob.glob(os.path.join(here, "av.libs", "libopus*.so*")))
    system = ctypes.util.find_library("opus")
    if system is not None:
        candidates.append(system)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        _declare(lib)
        return lib
    raise OpusError("libopus not found: neither PyAV's wheel nor the system has it (libopus0)")


def _declare(lib: ctypes.CDLL) -> None:
    i32, c_int, ptr = ctypes.c_int32, ctypes.c_int, ctypes.c_void_p
    lib.opus_encoder_create.restype = ptr
    lib.opus_encoder_create.argtypes = [i32, c_int, c_int, ctypes.POINTER(c_int)]
    lib.opus_encode.restype = i32
    lib.opus_encode.argtypes = [ptr, ptr, c_int, ptr, i32]
    lib.opus_encoder_destroy.argtypes = [ptr]
    lib.opus_decoder_create.restype = ptr
    lib.opus_decoder_create.argtypes = [i32, c_int, ctypes.POINTER(c_int)]
    lib.opus_decode.restype = c_int
    lib.opus_decode.argtypes = [ptr, ctypes.c_char_p, i32, ptr, c_int, c_int]
    lib.opus_decoder_destroy.argtypes = [ptr]
    lib.opus_encoder_ctl.restype = c_int
    lib.opus_strerror.restype = ctypes.c_char_p
    lib.opus_strerror.argtypes = [c_int]


def _check(code: int, what: str) -> int:
    if code < 0:
        reason = library().opus_strerror(code) or b"unknown error"
        raise OpusError(f"{what}: {reason.decode()}")
    return code


class _LibopusState:
    """A libopus encoder or decoder state: freed by :meth:`close` or when collected."""

    _DESTROY = ""
    """The libopus function that frees it."""
    _handle: int | None = None

    def _live(self) -> int:
        if self._handle is None:
            raise OpusError(f"the {type(self).__name__} is closed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            getattr(library(), self._DESTROY)(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class OpusMonoEncoder(_LibopusState):
    """A mono VoIP encoder: 16-bit samples of one frame in, its Opus packet out.

    Set as FFmpeg's libopus encoder sets itself by default (variable bit rate, unconstrained;
    complexity 10), so its packets are the ones PyAV's encoder would make.
    """

    _DESTROY = "opus_encoder_destroy"

    def __init__(self, rate: int, bit_rate: int, complexity: int = 10) -> None:
        lib = library()
        error = ctypes.c_int()
        handle = lib.opus_encoder_create(rate, 1, _APPLICATION_VOIP, ctypes.byref(error))
        _check(error.value, f"an Opus encoder at {rate} Hz")
        self._handle = handle
        for request, value, what in (
            (_SET_BITRATE, bit_rate, "bit rate"),
            (_SET_COMPLEXITY, complexity, "complexity"),
            (_SET_VBR_CONSTRAINT, 0, "VBR constraint"),
        ):
            # Variadic: no declared argument types, so every argument goes typed as it is.
            code = lib.opus_encoder_ctl(
                ctypes.c_void_p(handle), ctypes.c_int(request), ctypes.c_int32(value)
            )
            _check(code, f"the encoder's {what} ({value})")
        self._out = ctypes.create_string_buffer(_MAX_PACKET)

    def encode(self, pcm: np.ndarray) -> bytes:
        """One frame (2.5 to 60 ms of int16 samples) as one packet."""
        handle = self._live()
        samples = np.ascontiguousarray(pcm, np.int16)
        n = library().opus_encode(handle, samples.ctypes.data, len(samples), self._out, _MAX_PACKET)
        return self._out.raw[: _check(n, "encoding a frame")]


class OpusMonoDecoder(_LibopusState):
    """Any Opus stream (mono or stereo) decoded to mono int16 at ``rate`` (a DECODE_RATES one)."""

    _DESTROY = "opus_decoder_destroy"

    def __init__(self, rate: int) -> None:
        if rate not in DECODE_RATES:
            raise ValueError(f"libopus decodes at {DECODE_RATES} Hz, not {rate}")
        lib = library()
        error = ctypes.c_int()
        handle = lib.opus_decoder_create(rate, 1, ctypes.byref(error))
        _check(error.value, f"an Opus decoder at {rate} Hz")
        self._handle = handle
        self.rate = rate
        self._pcm = np.zeros(int(rate * _MAX_FRAME_S), np.int16)

    def decode(self, packet: bytes) -> np.ndarray:
        """One packet's samples (a copy); OpusError for a packet libopus cannot read."""
        handle = self._live()
        n = library().opus_decode(
            handle, packet, len(packet), self._pcm.ctypes.data, len(self._pcm), 0
        )
        return self._pcm[: _check(n, "decoding a packet")].copy()
