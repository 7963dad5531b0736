"""The MuseTalk engine on CPU with tiny random weights in the real on-disk layout.

The weights are built by the test (musetalk_core.tiny) and loaded through the real loading
code; nothing is patched. Random weights make meaningless faces, but every shape, dtype,
batch, thread hand-over and fallback is the real one.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from musetalk_core.engine import MuseTalkEngine
from musetalk_core.inference import StageTimes, decode_faces, infer_batch, predict_latents
from musetalk_core.models import PositionalEncoding, load_models, resolve_placement
from musetalk_core.musetalk_avatar import prepare_musetalk_avatar
from musetalk_core.runtime import MuseTalkRuntime
from musetalk_core.tiny import UNET_FULL, build_random_weights
from musetalk_core.types import AudioChunk, LipSyncEngine
from musetalk_core.vae_keys import modern_keys
from musetalk_core.warp_avatar import builtin_portrait
from musetalk_core.weights import (
    FILES,
    MANIFEST,
    RemoteInfo,
    WeightsError,
    check_layout,
    download_weights,
    git_blob_id,
    sha256_file,
    verify_weights,
    write_manifest,
)
from rtc_server.config import EngineSettings, ServerConfig
from rtc_server.engine_factory import load_engine_factory

RATE = 48_000
FRAME = RATE // 25


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_weights(tmp_path_factory.mktemp("weights") / "musetalk")


@pytest.fixture(scope="module")
def models(weights: Path):  # type: ignore[no-untyped-def]
    return load_models(weights, resolve_placement("cpu"))


@pytest.fixture(scope="module")
def runtime(models, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    material = prepare_musetalk_avatar(
        builtin_portrait(),
        models.encode_crops,
        encoder_id="tiny",
        cache_dir=tmp_path_factory.mktemp("material"),
    )
    rt = MuseTalkRuntime(models, material, max_batch=8, first_batch=2)
    rt.warm_up()
    yield rt
    rt.close()


def tone(seconds: float, hz: float, seed: int = 0) -> np.ndarray:
    """Voiced-like test audio: a tone with harmonics and an envelope, int16 at 48 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    wave = sum(np.sin(2 * np.pi * hz * k * t) / k for k in range(1, 5))
    wave *= 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    wave += 0.05 * rng.standard_normal(t.shape)
    return (wave / np.max(np.abs(wave)) * 12000).astype(np.int16)


# Loading ------------------------------------------------------------------------------------


def test_layout_is_the_release_layout(weights: Path) -> None:
    found = check_layout(weights)
    assert set(found) == {f.local for f in FILES}
    assert (weights / "musetalkV15" / "unet.pth").is_file()
    assert (weights / "sd-vae" / "config.json").is_file()
    assert (weights / "whisper" / "preprocessor_config.json").is_file()
    assert verify_weights(weights) == []
    # The full config keeps the published architecture.
    assert UNET_FULL["in_channels"] == 8 and UNET_FULL["cross_attention_dim"] == 384
    assert UNET_FULL["block_out_channels"] == [320, 640, 1280, 1280]


def test_models_load_with_shapes_and_dtypes(models) -> None:  # type: ignore[no-untyped-def]
    assert models.placement.device.type == "cpu"
    assert models.placement.dtype == torch.float32
    assert next(models.unet.parameters()).dtype == torch.float32
    assert models.unet.config.in_channels == 8
    assert models.latent_scale == pytest.approx(0.18215)
    crops = np.random.default_rng(0).integers(0, 255, (3, 256, 256, 3), dtype=np.uint8)
    latents = models.encode_crops(crops)
    assert latents.shape == (3, 4, 32, 32) and latents.dtype == np.float32
    unet_in = torch.from_numpy(np.concatenate([latents, latents], axis=1))
    audio = torch.randn(3, 50, 384)
    predicted = predict_latents(models, unet_in, audio)
    assert predicted.shape == (3, 4, 32, 32)
    faces = decode_faces(models, predicted)
    assert faces.shape == (3, 256, 256, 3) and faces.dtype == torch.uint8
    times = StageTimes()
    again = infer_batch(models, unet_in, audio, times)
    assert torch.equal(again, faces), "one step at timestep 0 is deterministic"
    assert times.batch == 3 and times.unet_ms > 0 and times.vae_ms > 0
    with pytest.raises(ValueError, match="batch mismatch"):
        predict_latents(models, unet_in, audio[:2])


def rewrite_manifest(root: Path) -> None:
    """The manifest of a release whose files a test replaced."""
    (root / MANIFEST).unlink()
    write_manifest(root)


def test_the_vae_loads_in_its_published_names_and_in_modern_ones(
    weights: Path,
    models,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    vae_file = Path("sd-vae") / "diffusion_pytorch_model.bin"
    published = torch.load(weights / vae_file, map_location="cpu", weights_only=True)
    # Written as sd-vae-ft-mse is published: the mid-block attention under its old names.
    attention = {k.rsplit(".", 2)[-2] for k in published if ".attentions." in k}
    assert attention == {"group_norm", "query", "key", "value", "proj_attn"}, attention
    modern_names = set(models.vae.state_dict())
    assert not set(published) <= modern_names  # a strict load of the file as it is would fail
    # The same tensors under the names diffusers uses now load as well, to the same model.
    modern = tmp_path / "modern"
    shutil.copytree(weights, modern)
    torch.save(modern_keys(published, modern_names), modern / vae_file)
    rewrite_manifest(modern)
    again = load_models(modern, resolve_placement("cpu"))
    crops = np.random.default_rng(1).integers(0, 255, (2, 256, 256, 3), dtype=np.uint8)
    assert np.array_equal(models.encode_crops(crops), again.encode_crops(crops))
    # A name that is neither is still refused, with the file named.
    torch.save(
        {**published, "decoder.mid_block.attentions.0.extra.weight": torch.zeros(1)},
        modern / vae_file,
    )
    rewrite_manifest(modern)
    with pytest.raises(WeightsError, match="diffusion_pytorch_model.bin"):
        load_models(modern, resolve_placement("cpu"))


def test_a_crop_round_trips_through_the_vae_as_upstream_scales_it(models) -> None:  # type: ignore[no-untyped-def]
    """Encode then decode a crop through our code path, and through upstream's formulas
    written out here: pixels to [-1, 1] as (x / 255 - 0.5) / 0.5, latents times the VAE's
    scaling factor 0.18215 (divided again before decoding), and back as
    (image / 2 + 0.5).clamp(0, 1) * 255, rounded."""
    crops = np.random.default_rng(2).integers(0, 255, (2, 256, 256, 3), dtype=np.uint8)
    ours = decode_faces(models, torch.from_numpy(models.encode_crops(crops))).numpy()
    with torch.inference_mode():
        x = torch.from_numpy(crops).permute(0, 3, 1, 2).float()
        x = (x / 255.0 - 0.5) / 0.5
        latents = models.vae.encode(x).latent_dist.mean * 0.18215
        image = models.vae.decode(latents / 0.18215).sample
        upstream = ((image / 2 + 0.5).clamp(0, 1) * 255).round().permute(0, 2, 3, 1).numpy()
    assert models.latent_scale == pytest.approx(0.18215)
    difference = np.abs(ours.astype(np.int16) - upstream.astype(np.int16))
    # The two spellings of the normalisation differ in the last float bit: a pixel may round
    # the other way, nothing more.
    assert difference.max() <= 1 and difference.mean() < 0.01, (difference.max(), difference.mean())


def test_positional_encoding_is_the_published_one() -> None:
    pe = PositionalEncoding(384)
    x = torch.zeros(1, 50, 384)
    out = pe(x)[0]
    pos, i = 7, 10  # channel 2i is sin(pos / 10000^(2i/d)), channel 2i+1 the cosine
    angle = pos / 10000 ** (2 * i / 384)
    assert out[pos, 2 * i].item() == pytest.approx(np.sin(angle), abs=1e-5)
    assert out[pos, 2 * i + 1].item() == pytest.approx(np.cos(angle), abs=1e-5)
    assert torch.allclose(pe(torch.ones(2, 50, 384)) - 1, out.expand(2, 50, 384), atol=1e-6)


def test_missing_or_corrupt_weights_are_named(weights: Path, tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="no MuseTalk weights directory"):
        load_models(tmp_path / "nowhere", resolve_placement("cpu"))
    broken = tmp_path / "broken"
    shutil.copytree(weights, broken)
    (broken / "musetalkV15" / "unet.pth").unlink()
    with pytest.raises(WeightsError, match=r"unet\.pth is missing"):
        load_models(broken, resolve_placement("cpu"))
    # Truncated: the manifest's size catches it before torch does.
    shutil.copy(weights / "musetalkV15" / "unet.pth", broken / "musetalkV15" / "unet.pth")
    with (broken / "musetalkV15" / "unet.pth").open("r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(WeightsError, match="truncated"):
        load_models(broken, resolve_placement("cpu"))
    # Garbage of the right size, no manifest: the loader says which file is bad.
    (broken / "manifest.json").unlink()
    (broken / "musetalkV15" / "unet.pth").write_bytes(b"not a checkpoint" * 100)
    with pytest.raises(WeightsError, match=r"unet\.pth: not a readable state dict"):
        load_models(broken, resolve_placement("cpu"))
    # A config that does not match the state dict.
    shutil.copy(weights / "musetalkV15" / "unet.pth", broken / "musetalkV15" / "unet.pth")
    config = json.loads((weights / "musetalkV15" / "musetalk.json").read_text())
    config["block_out_channels"] = [64, 128]
    (broken / "musetalkV15" / "musetalk.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="does not match"):
        load_models(broken, resolve_placement("cpu"))


def test_download_checks_every_file_against_the_hub(weights: Path, tmp_path: Path) -> None:
    """The download logic, with the hub's answers served from the tiny release."""
    fetched: list[str] = []

    def source(repo_id: str, remote: str) -> Path:
        wf = next(f for f in FILES if f.repo_id == repo_id and f.remote == remote)
        return next(weights / n for n in (wf.local, *wf.alternatives) if (weights / n).exists())

    def info(repo_id: str, paths: list[str]) -> dict[str, RemoteInfo]:
        out = {}
        for p in paths:
            path = source(repo_id, p)
            big = path.stat().st_size > 10_000  # LFS files carry a SHA-256, small ones a blob id
            out[p] = RemoteInfo(
                path.stat().st_size, sha256_file(path) if big else None, git_blob_id(path)
            )
        return out

    def fetch(repo_id: str, remote: str, target: Path) -> Path:
        fetched.append(remote)
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_suffix(target.suffix + ".part")
        shutil.copy(source(repo_id, remote), part)
        return part

    dest = tmp_path / "dl"
    download_weights(dest, info=info, fetch=fetch, log=lambda _: None)
    assert len(fetched) == len(FILES)
    assert verify_weights(dest) == []
    load_models(dest, resolve_placement("cpu"))  # what was fetched loads

    # A second run keeps every file that still matches.
    fetched.clear()
    download_weights(dest, info=info, fetch=fetch, log=lambda _: None)
    assert fetched == []

    # A corrupted transfer is refused and leaves nothing behind.
    def bad_fetch(repo_id: str, remote: str, target: Path) -> Path:
        part = fetch(repo_id, remote, target)
        part.write_bytes(part.read_bytes()[:-1] + b"x")
        return part

    (dest / "musetalkV15" / "unet.pth").unlink()
    with pytest.raises(WeightsError, match="checksum mismatch"):
        download_weights(dest, info=info, fetch=bad_fetch, log=lambda _: None)
    assert not (dest / "musetalkV15" / "unet.pth").exists()
    assert not list(dest.rglob("*.part"))
    # And a file changed on disk later is found by verify.
    download_weights(dest, info=info, fetch=fetch, log=lambda _: None)
    assert verify_weights(dest) == []
    cfg = dest / "sd-vae" / "config.json"
    cfg.write_text(cfg.read_text().replace("0.18215", "0.18216"))
    assert any("sd-vae/config.json" in p for p in verify_weights(dest))


# The engine ---------------------------------------------------------------------------------


async def collect(engine: LipSyncEngine, count: int) -> list:  # type: ignore[type-arg]
    frames = []
    it = engine.frames()
    for _ in range(count):
        frames.append(await asyncio.wait_for(anext(it), 30))
    await it.aclose()
    return frames


async def speak(engine: MuseTalkEngine, pcm: np.ndarray, segment_id: int) -> list:  # type: ignore[type-arg]
    """Push an utterance in 100 ms chunks and collect its speaking frames (every one rendered)."""
    for i in range(0, len(pcm), RATE // 10):
        await engine.push_audio(AudioChunk(pcm[i : i + RATE // 10], RATE), segment_id)
    await engine.end_segment(segment_id)
    expected = -(-len(pcm) // FRAME)
    spoken = []
    it = engine.frames()
    while len(spoken) < expected:
        frame = await asyncio.wait_for(anext(it), 60)
        if frame.speaking:
            spoken.append(frame)
    await it.aclose()
    return spoken


async def test_engine_interface_and_pairs(runtime: MuseTalkRuntime) -> None:
    # Slow CPU: let every frame wait for its face so the test checks rendering, not pacing.
    engine = MuseTalkEngine(runtime, frame_wait=30.0, start_wait=30.0)
    assert isinstance(engine, LipSyncEngine)
    assert engine.fps == 25 and engine.sample_rate == RATE
    assert engine.frame_size == runtime.avatar.frame_size
    assert engine.latency > 0.12
    idle = await collect(engine, 3)
    assert all(not f.speaking and f.segment_id == -1 for f in idle)
    assert all(len(f.audio.pcm) == FRAME and not f.audio.pcm.any() for f in idle)
    pcm = tone(0.5, 180)
    spoken = await speak(engine, pcm, 1)
    assert len(spoken) == 13  # 500 ms: 12 whole frames and one padded
    assert engine.degraded_frames == 0
    assert np.array_equal(np.concatenate([f.audio.pcm for f in spoken])[: len(pcm)], pcm)
    w, h = runtime.frame_size
    assert all(f.image.shape == (h, w, 3) and f.image.dtype == np.uint8 for f in spoken)
    # Blending only inside the crop box: outside it the avatar's own pixels, bit for bit.
    x1, y1, x2, y2 = runtime.avatar.crop_boxes[0]
    outside = np.ones((h, w), bool)
    outside[y1:y2, x1:x2] = False
    base = runtime.avatar.frames[0]
    for f in spoken:
        assert np.array_equal(f.image[outside], base[outside])
    assert any(not np.array_equal(f.image, base) for f in spoken), "faces were pasted"
    await engine.aclose()


async def test_two_calls_batched_together_get_their_own_frames(runtime: MuseTalkRuntime) -> None:
    """Two calls speak at once; the worker batches them, each gets exactly its own faces."""
    loud, other = tone(0.6, 150, seed=1), tone(0.6, 400, seed=2)
    alone = [runtime.render_now(p) for p in (loud, other)]
    batches_before = len(runtime.worker.stats.batch_sizes)
    a = MuseTalkEngine(runtime, frame_wait=30.0, start_wait=30.0)
    b = MuseTalkEngine(runtime, frame_wait=30.0, start_wait=30.0)
    got_a, got_b = await asyncio.gather(speak(a, loud, 7), speak(b, other, 7))
    sizes = runtime.worker.stats.batch_sizes[batches_before:]
    assert max(sizes) > runtime.worker.first_batch, f"no shared batch: {sizes}"
    # Random weights let the audio move the faces only a little, so compare exactly: batched
    # with another call, each frame is its own solo render (up to batched float rounding)
    # and further from the other call's frame at the same index wherever those differ.
    x1, y1, x2, y2 = runtime.avatar.face_boxes[0]
    differing = 0
    for got, own, foreign in ((got_a, alone[0], alone[1]), (got_b, alone[1], alone[0])):
        assert len(got) == len(own)
        for frame, mine, theirs in zip(got, own, foreign, strict=True):
            face = frame.image[y1:y2, x1:x2].astype(int)
            mine_err = np.abs(face - mine[y1:y2, x1:x2]).max()
            theirs_err = np.abs(face - theirs[y1:y2, x1:x2]).max()
            assert mine_err <= 1
            if theirs_err >= 3:
                differing += 1
                assert theirs_err > mine_err
    assert differing >= len(got_a), "the two calls' audio should give different faces"
    await a.aclose()
    await b.aclose()


async def test_clear_drops_the_utterance(runtime: MuseTalkRuntime) -> None:
    engine = MuseTalkEngine(runtime, frame_wait=30.0, start_wait=30.0)
    for _ in range(20):
        await engine.push_audio(AudioChunk(tone(0.1, 200), RATE), 3)
    engine.clear()
    frames = await collect(engine, 5)
    assert not any(f.speaking for f in frames)
    spoken = await speak(engine, tone(0.2, 200), 4)
    assert {f.segment_id for f in spoken} == {4}
    await engine.aclose()


async def test_slower_than_real_time_plays_the_audio_over_idle_images(
    runtime: MuseTalkRuntime,
) -> None:
    """Frames whose faces are late are shown with the idle image; the audio is all there."""
    engine = MuseTalkEngine(runtime, frame_wait=0.0, start_wait=30.0)
    pcm = tone(1.0, 220)
    spoken = await speak(engine, pcm, 5)
    assert len(spoken) == 25
    assert np.array_equal(np.concatenate([f.audio.pcm for f in spoken]), pcm)
    assert engine.degraded_frames > 0  # on 2 CPU cores tiny MuseTalk is not real time
    await engine.aclose()


# Choosing the engine ------------------------------------------------------------------------


def test_missing_weights_fall_back_to_warp_with_a_notice(tmp_path: Path) -> None:
    factory = load_engine_factory(
        ServerConfig.of(
            engine=EngineSettings(name="musetalk", weights_dir=tmp_path / "none"),
            cache_dir=tmp_path,
        )
    )
    assert factory.name == "warp"
    assert factory.notice is not None and "no MuseTalk weights directory" in factory.notice
    auto = load_engine_factory(
        ServerConfig.of(
            engine=EngineSettings(name="auto", weights_dir=tmp_path / "none"), cache_dir=tmp_path
        )
    )
    assert auto.name == "warp" and auto.notice is None
    assert "no MuseTalk weights directory" in auto.reason


def test_corrupt_weights_fall_back_to_warp(weights: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(weights, broken)
    (broken / "manifest.json").unlink()
    (broken / "sd-vae" / "diffusion_pytorch_model.bin").write_bytes(b"\0" * 64)
    factory = load_engine_factory(
        ServerConfig.of(
            engine=EngineSettings(name="musetalk", weights_dir=broken), cache_dir=tmp_path
        )
    )
    assert factory.name == "warp"
    assert factory.notice is not None and "sd-vae" in factory.notice


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_auto_without_cuda_explains_itself(weights: Path, tmp_path: Path) -> None:
    factory = load_engine_factory(
        ServerConfig.of(engine=EngineSettings(name="auto", weights_dir=weights), cache_dir=tmp_path)
    )
    assert factory.name == "warp"
    assert "no CUDA" in factory.reason


class RunsOutOfMemory:
    """The UNet, until its ``after``-th batch: then CUDA's out-of-memory error."""

    def __init__(self, unet, after: int) -> None:  # type: ignore[no-untyped-def]
        self.unet, self.after, self.calls = unet, after, 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.unet, name)

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls > self.after:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return self.unet(*args, **kwargs)


async def test_out_of_memory_mid_utterance_hands_the_call_to_warp(
    models, runtime: MuseTalkRuntime, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from musetalk_core.warp_avatar import prepare_avatar
    from musetalk_core.warp_engine import WarpEngine
    from rtc_server.media.resilient_engine import ResilientEngine

    failing = dataclasses.replace(models, unet=RunsOutOfMemory(models.unet, after=1))
    rt = MuseTalkRuntime(failing, runtime.avatar, max_batch=4, first_batch=2)
    warp_avatar = prepare_avatar(builtin_portrait(), cache_dir=tmp_path)
    failures: list[BaseException] = []
    engine = ResilientEngine(
        MuseTalkEngine(rt, frame_wait=30.0, start_wait=30.0),
        on_failure=failures.append,
        fallback=lambda: WarpEngine(warp_avatar, fps=25, sample_rate=RATE),
        stall_s=60.0,  # a batch on a busy CPU takes seconds: the failure must be the OOM
    )
    pcm = tone(1.0, 200)
    await engine.push_audio(AudioChunk(pcm, RATE), 1)
    await engine.end_segment(1)
    spoken = []
    frames = engine.frames()
    while len(spoken) < 25:
        frame = await asyncio.wait_for(anext(frames), 60)
        if frame.speaking:
            spoken.append(frame)
    await frames.aclose()
    await engine.aclose()
    rt.close()
    assert len(failures) == 1 and isinstance(failures[0], RuntimeError)
    assert isinstance(failures[0].__cause__, torch.cuda.OutOfMemoryError)
    assert engine.replaced and isinstance(engine.engine, WarpEngine)
    assert np.array_equal(np.concatenate([f.audio.pcm for f in spoken]), pcm)
    # The first batch was MuseTalk's; the rest of the sentence is warp's moving mouth.
    assert spoken[0].image.shape == spoken[-1].image.shape
    assert len({f.image.tobytes() for f in spoken[2:]}) > 5
