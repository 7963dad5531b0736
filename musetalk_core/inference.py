"""One MuseTalk step on a batch: audio prompts and avatar latents in, 256x256 faces out.

Pure functions under ``torch.inference_mode()``: no threads, no queues, no I/O. Single-step
latent inpainting: the UNet runs once at timestep 0 on the 8-channel input (masked-target and
reference latents) with the positional-encoded [50, 384] audio prompt as cross-attention
context, and its output latents are decoded by the VAE.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .models import MuseTalkModels

__all__ = ["StageTimes", "compile_models", "decode_faces", "infer_batch", "predict_latents"]


@dataclass(slots=True)
class StageTimes:
    """Wall milliseconds per stage of the last batch (synchronised on CUDA when measured)."""

    features_ms: float = 0.0
    unet_ms: float = 0.0
    vae_ms: float = 0.0
    blend_ms: float = 0.0
    batch: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def _sync(models: MuseTalkModels) -> None:
    if models.placement.device.type == "cuda":
        torch.cuda.synchronize(models.placement.device)


@torch.inference_mode()
def predict_latents(
    models: MuseTalkModels, latents: torch.Tensor, audio: torch.Tensor
) -> torch.Tensor:
    """(B, 8, 32, 32) UNet input and (B, 50, 384) audio prompts → (B, 4, 32, 32) latents."""
    if latents.shape[0] != audio.shape[0]:
        raise ValueError(f"batch mismatch: {latents.shape[0]} latents, {audio.shape[0]} prompts")
    place = models.placement
    latents = latents.to(device=place.device, dtype=place.dtype)
    prompts = models.pe(audio.to(device=place.device, dtype=place.dtype))
    timestep = torch.zeros((), device=place.device, dtype=torch.long)
    out: torch.Tensor = models.unet(latents, timestep, encoder_hidden_states=prompts).sample
    return out


@torch.inference_mode()
def decode_faces(models: MuseTalkModels, latents: torch.Tensor) -> torch.Tensor:
    """(B, 4, 32, 32) latents → (B, 256, 256, 3) uint8 RGB faces, on the models' device."""
    image = models.vae.decode(latents / models.latent_scale).sample
    image = ((image.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    faces: torch.Tensor = image.permute(0, 2, 3, 1).contiguous()
    return faces


def infer_batch(
    models: MuseTalkModels,
    latents: torch.Tensor,
    audio: torch.Tensor,
    times: StageTimes | None = None,
) -> torch.Tensor:
    """Both steps; fills ``times`` (UNet and VAE wall ms) when given."""
    t0 = time.perf_counter()
    predicted = predict_latents(models, latents, audio)
    if times is not None:
        _sync(models)
    t1 = time.perf_counter()
    faces = decode_faces(models, predicted)
    if times is not None:
        _sync(models)
        t2 = time.perf_counter()
        times.unet_ms = (t1 - t0) * 1000
        times.vae_ms = (t2 - t1) * 1000
        times.batch = int(latents.shape[0])
    return faces


def compile_models(models: MuseTalkModels) -> None:
    """``torch.compile`` the UNet and the VAE decoder in place (``--musetalk-compile``).

    The first batches of each new size are slow while kernels are built; steady state is
    faster on CUDA. Batch sizes vary (first batch, shared batches), so ``dynamic=True``.
    """
    models.unet = torch.compile(models.unet, dynamic=True)
    models.vae.decoder = torch.compile(models.vae.decoder, dynamic=True)
