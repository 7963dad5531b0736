"""``bench engine --engine musetalk``: MuseTalk throughput, first-frame latency, memory, stages.

One short command for a GPU machine (and an informational run on CPU with random weights):

    avatar-rtc bench engine --engine musetalk --weights-dir WEIGHTS --batch-sizes 1,4,8,16

Without ``--weights-dir`` it builds a random-weight release (``--random tiny`` or ``full``, the
real architecture) in a temporary folder: the figures are then the cost of the architecture,
the faces meaningless. Per batch size it times the stages of one step as the worker runs them
(UNet, VAE decode, blend into the full frame; CUDA synchronised between stages), the audio
features once per batch (one whisper-encoder window), and reports frames per second of the
whole step. First-frame latency is measured through a real :class:`MuseTalkEngine`: from an
utterance pushed (as Piper pushes a sentence) to its first face coming out of ``frames()``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.report import summary


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(
    *,
    weights_dir: Path | None,
    random: str = "tiny",
    device: str = "auto",
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16),
    rounds: int = 3,
    compile_models: bool = False,
    blend_size: tuple[int, int] = (1280, 720),
    speech: np.ndarray | None = None,
) -> dict[str, Any]:
    """``speech``: mono int16 at 48 kHz to drive the engine with; None speaks the first
    sentence of the benchmark paragraph with the bundled Piper voice."""
    from musetalk_core.blending import time_blends
    from musetalk_core.engine import MuseTalkEngine
    from musetalk_core.features import Downsampler
    from musetalk_core.inference import decode_faces, predict_latents
    from musetalk_core.loading import load_musetalk
    from musetalk_core.tiny import build_random_weights
    from musetalk_core.warp_avatar import builtin_portrait

    with tempfile.TemporaryDirectory(prefix="bench-musetalk-") as tmp:
        if weights_dir is None:
            _progress(f"building a random-weight release ({random}) ...")
            weights_dir = build_random_weights(Path(tmp) / "weights", random)  # type: ignore[arg-type]
            source = f"random-{random}"
        else:
            source = str(weights_dir)
        _progress("loading the weights and preparing the avatar ...")
        loaded = load_musetalk(
            weights_dir,
            builtin_portrait(),
            cache_dir=Path(tmp) / "c",
            device=device,
            compile_models=compile_models,
            encoder_id=source,
        )
        models, material, placement = loaded.models, loaded.material, loaded.placement
        load_ms = loaded.load_ms
        _progress(f"loaded on {placement} in {load_ms:.0f} ms")
        runtime = loaded.runtime(max_batch=max(batch_sizes), first_batch=2)
        if speech is None:
            from benchmarks.clip import PARAGRAPH, speech_pcm

            speech = asyncio.run(speech_pcm(PARAGRAPH.split(".")[0] + "."))
        speech16 = Downsampler().process(speech)
        dev = placement.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        rows = []
        for batch in batch_sizes:
            _progress(f"batch {batch}: {rounds} rounds ...")
            idx = [i % len(material) for i in range(batch)]
            latents = runtime.latents[torch.tensor(idx, device=runtime.latents.device)]
            stage: dict[str, list[float]] = {"features": [], "unet": [], "vae": [], "blend": []}
            totals, cpu = [], []
            for r in range(rounds + 1):  # the first round warms up and is not counted
                c0, w0 = time.process_time(), time.perf_counter()
                stream = _stream(runtime, speech16, batch)
                t = time.perf_counter()
                prompts = stream.take(batch)
                _sync(dev)
                t_feat = time.perf_counter()
                predicted = predict_latents(models, latents, prompts.to(dev))
                _sync(dev)
                t_unet = time.perf_counter()
                faces = decode_faces(models, predicted)
                _sync(dev)
                t_vae = time.perf_counter()
                runtime.blend(faces, idx)
                _sync(dev)
                t_blend = time.perf_counter()
                if r == 0:
                    continue
                stage["features"].append((t_feat - t) * 1000)
                stage["unet"].append((t_unet - t_feat) * 1000)
                stage["vae"].append((t_vae - t_unet) * 1000)
                stage["blend"].append((t_blend - t_vae) * 1000)
                totals.append((t_blend - w0) * 1000)
                cpu.append((time.process_time() - c0) * 1000)
            step = statistics.median(totals)
            rows.append(
                {
                    "batch": batch,
                    "step_ms": summary(totals),
                    "fps": round(batch * 1000 / step, 2),
                    "ms_per_frame": round(step / batch, 2),
                    "cpu_ms_per_frame": round(statistics.median(cpu) / batch, 2),
                    "stages_ms": {k: round(statistics.median(v), 2) for k, v in stage.items()},
                    "samples_ms": totals,
                }
            )
        first = _first_frame_ms(runtime, speech, MuseTalkEngine, repeats=3)
        memory = (
            {
                "peak_allocated_mib": round(torch.cuda.max_memory_allocated(dev) / 2**20, 1),
                "reserved_mib": round(torch.cuda.memory_reserved(dev) / 2**20, 1),
            }
            if dev.type == "cuda"
            else None
        )
        blends = time_blends(
            blend_size, n=20, torch_device=str(dev) if dev.type == "cuda" else None
        )
        runtime.close()
    return {
        "engine": "musetalk",
        "weights": source,
        "compiled": compile_models,
        "placement": str(placement),
        "load_ms": round(load_ms, 1),
        "frame_size": list(material.frame_size),
        "batches": rows,
        "first_frame_ms": first,
        "gpu_memory": memory,
        "blend_ms": blends | {"frame_size": list(blend_size)},
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }


def _stream(runtime: Any, speech16: np.ndarray, frames: int) -> Any:
    from musetalk_core.features import FeatureStream

    stream = FeatureStream(runtime.features, lookahead_s=runtime.lookahead_s)
    need = min(len(speech16), (frames + 8) * 640)
    stream.push(speech16[:need])
    stream.end()
    return stream


def _first_frame_ms(runtime: Any, speech: np.ndarray, engine_cls: Any, repeats: int) -> Any:
    from musetalk_core.types import AudioChunk

    async def once() -> float:
        engine = engine_cls(runtime, frame_wait=60.0, start_wait=60.0)
        frames = engine.frames()
        await anext(frames)
        t0 = time.perf_counter()
        await engine.push_audio(AudioChunk(speech, 48_000), 1)
        await engine.end_segment(1)
        while not (await anext(frames)).speaking:
            pass
        elapsed = (time.perf_counter() - t0) * 1000
        await frames.aclose()
        await engine.aclose()
        return elapsed

    samples = [asyncio.run(once()) for _ in range(repeats + 1)][1:]
    return summary(samples) | {"samples": samples}
