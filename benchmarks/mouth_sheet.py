"""A contact sheet of the warp engine's mouth on one sentence: from loudness (top) and from the
voice's phonemes (bottom), every frame of the first 1.92 s (``docs/mouth-sheet.png``).

    python -m benchmarks.mouth_sheet [--out docs/mouth-sheet.png] [--text "..."]

Each tile is labelled with the viseme that leads at its frame's middle (from the phonemes), so
the closed lips of "PP" and the tucked lip of "FF" can be checked by eye against the row above.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt

from musetalk_core.types import AudioChunk
from musetalk_core.visemes import VISEMES, VisemeTimeline
from musetalk_core.warp_avatar import WarpAvatar, builtin_portrait, prepare_avatar
from musetalk_core.warp_engine import WarpEngine
from rtc_server.media.resample import resample_int16
from rtc_server.providers.piper_tts import PiperTTS

U8 = npt.NDArray[np.uint8]
TEXT = "Bob met a vain friend at the bus stop."
TILES = 48
PER_ROW = 16


async def speaking_frames(avatar: WarpAvatar, chunks: list[AudioChunk], timed: bool) -> list[U8]:
    """The warp engine's frames of ``chunks`` (one segment), with their phonemes if ``timed``."""
    engine = WarpEngine(avatar)
    for c in chunks:
        pcm = resample_int16(c.pcm, c.sample_rate, engine.sample_rate)
        await engine.push_audio(AudioChunk(pcm, engine.sample_rate, c.phonemes if timed else ()), 1)
    await engine.end_segment(1)
    out = []
    async for frame in engine.frames():
        if not frame.speaking:
            break
        out.append(np.asarray(frame.image, np.uint8))
    await engine.aclose()
    return out


async def _render(text: str) -> U8:
    tts = PiperTTS.load(deterministic=True)
    chunks = [c async for c in tts.synthesize(text)]
    avatar = prepare_avatar(builtin_portrait())
    timeline = VisemeTimeline()
    at = 0.0
    for c in chunks:
        timeline.add(c.phonemes, at)
        at += c.duration
    x, y, w, h = avatar.mouth_box
    pad = int(0.6 * h)
    rows = []
    for timed in (False, True):
        frames = await speaking_frames(avatar, chunks, timed)
        tiles = []
        for k in range(TILES):
            frame = frames[min(k, len(frames) - 1)]
            crop = frame[max(0, y - pad) : y + h + pad, max(0, x - pad // 2) : x + w + pad // 2]
            tile = cv2.resize(crop, (96, round(96 * crop.shape[0] / crop.shape[1])))
            tile = np.ascontiguousarray(tile)
            label = VISEMES[int(np.argmax(timeline.weights((k + 0.5) / 25)))]
            cv2.putText(tile, label, (3, 12), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 0), 1)
            tiles.append(tile)
        lines = [np.concatenate(tiles[i : i + PER_ROW], axis=1) for i in range(0, TILES, PER_ROW)]
        rows.append(np.concatenate(lines, axis=0))
    gap = np.full((8, rows[0].shape[1], 3), 255, np.uint8)
    return np.concatenate([rows[0], gap, rows[1]], axis=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/mouth-sheet.png"))
    parser.add_argument("--text", default=TEXT)
    args = parser.parse_args(argv)
    sheet = asyncio.run(_render(args.text))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(args.out), cv2.cvtColor(sheet, cv2.COLOR_RGB2BGR))
    print(f"wrote {args.out} ({sheet.shape[1]}x{sheet.shape[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
