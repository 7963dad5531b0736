"""The reference avatar clip: the built-in avatar saying a paragraph through the warp engine."""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from musetalk_core.types import AudioChunk
from rtc_server.config import ServerConfig
from rtc_server.engine_factory import EngineFactory, load_engine_factory
from rtc_server.media.resample import resample_int16
from rtc_server.providers.piper_tts import PiperTTS

PARAGRAPH = (
    "Hello, and welcome. I am the avatar of this server, and I can talk with you in real time. "
    "Ask me anything you like, and I will do my best to answer quickly and clearly."
)


@dataclass
class Clip:
    images: list[np.ndarray]
    """uint8 RGB (an engine's I420 frames converted back, as a decoder would)."""
    audio: np.ndarray
    """48 kHz mono int16, exactly 1920 samples per image."""
    speaking: list[bool]
    fps: int
    mouth_box: tuple[int, int, int, int] | None


def engine_factory(cache_dir: Path | None = None, framing: str = "head") -> EngineFactory:
    """The server's engine, the built-in avatar framed by ``framing`` (head or full)."""
    cache = cache_dir or Path(tempfile.gettempdir()) / "avatar-rtc-bench"
    return load_engine_factory(ServerConfig.of(cache_dir=cache, framing=framing))


async def render_clip(
    frames: int, *, factory: EngineFactory | None = None, text: str = PARAGRAPH
) -> Clip:
    """``frames`` frames of the avatar speaking ``text`` (idle after it ends)."""
    factory = factory or engine_factory()
    tts = PiperTTS.load()
    engine = factory.create()
    try:
        async for chunk in tts.synthesize(text):
            pcm = resample_int16(chunk.pcm, chunk.sample_rate, engine.sample_rate)
            await engine.push_audio(AudioChunk(pcm, engine.sample_rate, chunk.phonemes), 0)
        await engine.end_segment(0)
        images: list[np.ndarray] = []
        audio: list[np.ndarray] = []
        speaking: list[bool] = []
        stream = engine.frames()
        while len(images) < frames:
            frame = await anext(stream)
            images.append(_rgb(frame.image))
            audio.append(frame.audio.pcm)
            speaking.append(frame.speaking)
        return Clip(images, np.concatenate(audio), speaking, engine.fps, factory.mouth_box)
    finally:
        await engine.aclose()


def _rgb(image: np.ndarray) -> np.ndarray:
    if image.ndim == 3:
        return image
    rgb: np.ndarray = av.VideoFrame.from_ndarray(image, format="yuv420p").to_ndarray(format="rgb24")
    return rgb


def render_clip_sync(frames: int, **kw: object) -> Clip:
    return asyncio.run(render_clip(frames, **kw))  # type: ignore[arg-type]


async def speech_pcm(text: str, sample_rate: int = 48_000) -> np.ndarray:
    """``text`` spoken by the bundled Piper voice, mono int16 at ``sample_rate``.

    Deterministic: the same text gives the same audio, so a caller's words are the same input
    in every run.
    """
    tts = PiperTTS.load(deterministic=True)
    parts = [resample_int16(c.pcm, c.sample_rate, sample_rate) async for c in tts.synthesize(text)]
    return np.concatenate(parts)


async def speech_split(
    text: str, after_words: int, sample_rate: int = 48_000
) -> tuple[np.ndarray, np.ndarray]:
    """``text`` spoken in one breath by the bundled voice, cut in two after its first
    ``after_words`` words: the parts of a caller who stops mid-sentence, with the sentence's own
    prosody (the first words spoken alone would end as a finished sentence does).

    The cut falls where the word gap the voice's phoneme timing gives begins; each part
    fades over 5 ms at the cut (no click).
    """
    tts = PiperTTS.load(deterministic=True)
    chunks = [c async for c in tts.synthesize(text)]
    if len(chunks) != 1:
        raise ValueError(f"{text!r} is more than one sentence for the voice")
    chunk = chunks[0]
    gaps = [p for p in chunk.phonemes if p.phoneme == " "]
    if not 0 < after_words <= len(gaps):
        raise ValueError(f"{text!r} has no gap after word {after_words}")
    gap = gaps[after_words - 1]
    cut = round(gap.start * chunk.sample_rate)
    fade = np.linspace(1.0, 0.0, chunk.sample_rate // 200)
    first = chunk.pcm[:cut].astype(np.float32)
    second = chunk.pcm[cut:].astype(np.float32)
    first[-len(fade) :] *= fade
    second[: len(fade)] *= fade[::-1]
    return (
        resample_int16(first.astype(np.int16), chunk.sample_rate, sample_rate),
        resample_int16(second.astype(np.int16), chunk.sample_rate, sample_rate),
    )


async def speech_with_pause(
    text: str, after_words: int, pause_ms: int, sample_rate: int = 48_000
) -> np.ndarray:
    """:func:`speech_split`'s parts with ``pause_ms`` of silence between them."""
    first, second = await speech_split(text, after_words, sample_rate)
    silence = np.zeros(pause_ms * sample_rate // 1000, np.int16)
    return np.concatenate([first, silence, second])
