"""Trains the viseme estimator (``rtc_server/media/viseme_estimator.py``) on speech the bundled
Piper voice aligned itself, and writes its weights.

    python -m benchmarks.train_visemes --out rtc_server/media/viseme_estimator.npz

Sentences from ``benchmarks/viseme_sentences.py`` (generated; the held-out ones never), spoken
by the voice (deterministic), labelled per 10 ms frame with the class of the phoneme the voice
says it is saying there. Gains and a little noise vary the copies; one hidden layer, trained
with torch on one thread, seeded: the same command gives the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np

from benchmarks.viseme_sentences import HELD_OUT, training_sentences
from musetalk_core.types import PhonemeSpan
from musetalk_core.visemes import viseme_of
from rtc_server.media.resample import resample_int16
from rtc_server.media.viseme_estimator import CONTEXT, MELS, RATE, log_mel, stack_context

CLASS_OF = {
    "sil": 0,
    "PP": 1,
    "FF": 2,
    "aa": 3,
    "oh": 4,
    "ou": 4,
    "E": 5,
    "ih": 5,
    "SS": 6,
    "CH": 6,
    "TH": 6,
    "DD": 7,
    "kk": 7,
    "nn": 7,
    "RR": 7,
}


def frame_labels(spans: list[PhonemeSpan], frames: int) -> np.ndarray:
    """The class of each 10 ms frame: the phoneme sounding at its middle (a symbol without a
    shape of its own, a stress mark or "h", takes the next phoneme's; at the end the last's)."""
    classes: list[int | None] = []
    for s in spans:
        v = viseme_of(s.phoneme)
        classes.append(None if v is None else CLASS_OF[v])
    resolved: list[int] = [0] * len(classes)
    following: int | None = None
    for i in range(len(classes) - 1, -1, -1):
        if classes[i] is not None:
            following = classes[i]
        resolved[i] = following if following is not None else 0
    ends = np.array([s.end for s in spans])
    middles = (np.arange(frames) + 0.5) / 100
    index = np.minimum(np.searchsorted(ends, middles, side="right"), len(spans) - 1)
    return np.asarray(resolved, np.int64)[index]


async def _speak(texts: list[str]) -> list[tuple[np.ndarray, list[PhonemeSpan]]]:
    from rtc_server.providers.piper_tts import PiperTTS

    tts = PiperTTS.load(deterministic=True)
    if not tts.has_timing:
        raise SystemExit("the Piper voice reports no phoneme timing (is onnx installed?)")
    out = []
    for text in texts:
        pcm, spans, at = [], [], 0.0
        async for chunk in tts.synthesize(text):
            audio = resample_int16(chunk.pcm, chunk.sample_rate, RATE)
            pcm.append(audio)
            spans += [PhonemeSpan(s.phoneme, s.start + at, s.end + at) for s in chunk.phonemes]
            at += len(audio) / RATE
        out.append((np.concatenate(pcm), spans))
    return out


def dataset(
    spoken: list[tuple[np.ndarray, list[PhonemeSpan]]], rng: np.random.Generator, copies: int
) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for pcm, spans in spoken:
        frames = len(pcm) // 160
        labels = frame_labels(spans, frames)
        for copy in range(copies):
            audio = pcm.astype(np.float32) / 32768.0
            if copy:
                audio = audio * rng.uniform(0.25, 1.6) + rng.normal(
                    0, 10 ** rng.uniform(-4.5, -3), len(audio)
                )
            feats = log_mel(audio.astype(np.float32), 0, frames)
            xs.append(stack_context(feats))
            ys.append(labels)
    return np.concatenate(xs), np.concatenate(ys)


def train(
    x: np.ndarray, y: np.ndarray, *, hidden: int, epochs: int, seed: int
) -> dict[str, np.ndarray]:
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-3
    xt = torch.from_numpy(((x - mean) / std).astype(np.float32))
    yt = torch.from_numpy(y)
    model = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 8)
    )
    counts = np.bincount(y, minlength=8).astype(np.float64)
    # Lips that close or touch the teeth are rare and what viewers read: weigh them up.
    weight = torch.tensor((counts.sum() / np.maximum(counts, 1) / 8) ** 0.7, dtype=torch.float32)
    loss_fn = torch.nn.CrossEntropyLoss(weight=weight)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=1e-5)
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(xt), generator=generator)
        total = 0.0
        for i in range(0, len(order), 512):
            batch = order[i : i + 512]
            opt.zero_grad()
            loss = loss_fn(model(xt[batch]), yt[batch])
            loss.backward()
            opt.step()
            total += float(loss) * len(batch)
        print(f"epoch {epoch + 1}: loss {total / len(order):.3f}", flush=True)
    first, last = model[0], model[2]
    assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
    return {
        "mean": mean.astype(np.float32),
        "std": std.astype(np.float32),
        "w1": first.weight.detach().numpy().T.astype(np.float32),
        "b1": first.bias.detach().numpy().astype(np.float32),
        "w2": last.weight.detach().numpy().T.astype(np.float32),
        "b2": last.bias.detach().numpy().astype(np.float32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("rtc_server/media/viseme_estimator.npz"))
    parser.add_argument("--sentences", type=int, default=400)
    parser.add_argument("--copies", type=int, default=2, help="each sentence, varied")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()
    texts = training_sentences(args.sentences, args.seed)
    assert not set(texts) & set(HELD_OUT), "a held-out sentence in the training set"
    spoken = asyncio.run(_speak(texts))
    x, y = dataset(spoken, np.random.default_rng(args.seed), args.copies)
    classes = np.bincount(y, minlength=8)
    print(f"{len(texts)} sentences, {len(y) / 100:.0f} s of frames; classes {classes}")
    assert x.shape[1] == CONTEXT * MELS
    weights = train(x, y, hidden=args.hidden, epochs=args.epochs, seed=args.seed)
    np.savez_compressed(args.out, **weights)  # type: ignore[arg-type]
    size, took = args.out.stat().st_size / 1024, time.monotonic() - started
    print(f"wrote {args.out} ({size:.0f} KiB) in {took:.0f} s")


if __name__ == "__main__":
    main()
