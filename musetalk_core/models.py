"""Loading MuseTalk 1.5: UNet, VAE, whisper-tiny encoder and the positional encoding.

Device and dtype are decided once, in :func:`resolve_placement` (fp16 on CUDA, fp32 on CPU);
nothing else in the package asks torch about CUDA. Weights load with ``weights_only`` (plain
tensors, no pickled code). The UNet is built on the ``meta`` device and its state dict assigned,
so the 850 M-parameter model is never randomly initialised just to be overwritten.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from .vae_keys import modern_keys
from .weights import UNET_CONFIG, UNET_WEIGHTS, VAE_DIR, WHISPER_DIR, WeightsError, check_layout

__all__ = [
    "FACE_SIZE",
    "LATENT_SCALE",
    "MuseTalkModels",
    "Placement",
    "PositionalEncoding",
    "load_models",
    "resolve_placement",
]

logger = logging.getLogger(__name__)

FACE_SIZE = 256
"""MuseTalk works on 256x256 face crops (latents 4x32x32)."""
LATENT_SCALE = 0.18215
"""sd-vae-ft-mse's scaling factor (used when the VAE config does not carry one)."""
AUDIO_DIM = 384
"""whisper-tiny's width: the UNet's cross-attention dimension."""


@dataclass(frozen=True, slots=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.device.type} {str(self.dtype).removeprefix('torch.')}"


def resolve_placement(device: str = "auto", dtype: str = "auto") -> Placement:
    """The one place that decides where the models run: CUDA in fp16 when there is a GPU,
    else CPU in fp32 (fp16 on CPU is slow and poorly supported)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        dt = torch.float16 if dev.type == "cuda" else torch.float32
    else:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    if dev.type == "cpu" and dt == torch.float16:
        logger.warning("fp16 on CPU is slow and partly unsupported; using fp32")
        dt = torch.float32
    return Placement(dev, dt)


class PositionalEncoding(nn.Module):
    """Sinusoidal positions added to the [50, 384] audio prompt of each frame (MuseTalk's
    ``PositionalEncoding(d_model=384)``: sine on even channels, cosine on odd ones)."""

    pe: torch.Tensor

    def __init__(self, d_model: int = AUDIO_DIM, max_len: int = 5000) -> None:
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -math.log(1e4) / d_model)
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:, : x.shape[1], :].to(dtype=x.dtype)


@dataclass(slots=True)
class MuseTalkModels:
    """The loaded networks, all on ``placement``; inference code takes this as given."""

    unet: Any
    """diffusers UNet2DConditionModel."""
    vae: Any
    """diffusers AutoencoderKL."""
    whisper_encoder: Any
    """transformers WhisperEncoder."""
    feature_extractor: Any
    """transformers WhisperFeatureExtractor."""
    pe: PositionalEncoding
    placement: Placement
    latent_scale: float
    weights_dir: Path

    @torch.inference_mode()
    def encode_crops(self, crops: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
        """VAE latents of (B, 256, 256, 3) uint8 RGB crops: (B, 4, 32, 32), scaled.

        The distribution's mean, not a sample (upstream samples): the same avatar always gets
        the same latents, so cached preparations are reproducible.
        """
        x = torch.from_numpy(np.ascontiguousarray(crops)).to(self.placement.device)
        x = x.permute(0, 3, 1, 2).to(self.placement.dtype) / 127.5 - 1.0
        latents = self.vae.encode(x).latent_dist.mean * self.latent_scale
        out: npt.NDArray[np.float32] = latents.float().cpu().numpy()
        return out


def _load_unet(config_path: Path, weights_path: Path, placement: Placement) -> Any:
    from diffusers import UNet2DConditionModel

    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{config_path}: not a readable UNet config: {exc}") from exc
    state = _state_dict(weights_path)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    try:
        unet.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise WeightsError(f"{weights_path} does not match {config_path}: {exc}") from exc
    return unet.to(device=placement.device, dtype=placement.dtype).eval()


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint as plain tensors: safetensors, or a torch file read with ``weights_only``."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise WeightsError(f"{path}: not a readable state dict: {exc}") from exc
    if not isinstance(state, dict):
        raise WeightsError(f"{path}: expected a state dict, found {type(state).__name__}")
    return state


def _load_vae(folder: Path, placement: Placement) -> Any:
    from diffusers import AutoencoderKL

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{folder / 'config.json'}: not a readable VAE config: {exc}") from exc
    weights = folder / "diffusion_pytorch_model.safetensors"
    if not weights.exists():
        weights = folder / "diffusion_pytorch_model.bin"
    state = _state_dict(weights)
    try:
        with torch.device("meta"):
            vae = AutoencoderKL.from_config(config)
        # sd-vae-ft-mse stores its attention under the names diffusers used before (query,
        # key, value, proj_attn): musetalk_core.vae_keys.
        state = modern_keys(state, set(vae.state_dict()))
        vae.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise WeightsError(f"{weights} does not match {folder / 'config.json'}: {exc}") from exc
    return vae.to(device=placement.device, dtype=placement.dtype).eval()


def _load_whisper(folder: Path, placement: Placement) -> tuple[Any, Any]:
    from transformers import WhisperFeatureExtractor, WhisperModel

    try:
        model = WhisperModel.from_pretrained(folder, dtype=placement.dtype)
        extractor = WhisperFeatureExtractor.from_pretrained(folder)
    except Exception as exc:
        raise WeightsError(f"{folder}: not a loadable whisper folder: {exc}") from exc
    encoder = model.get_encoder().to(placement.device).eval()
    if encoder.config.d_model != AUDIO_DIM:
        raise WeightsError(f"{folder}: whisper width {encoder.config.d_model}, MuseTalk needs 384")
    return encoder, extractor


def load_models(weights_dir: str | os.PathLike[str], placement: Placement) -> MuseTalkModels:
    """Load the release from ``weights_dir`` (layout in :mod:`musetalk_core.weights`).

    Raises :class:`~musetalk_core.weights.WeightsError` with the file at fault.
    """
    root = Path(weights_dir)
    check_layout(root)
    from diffusers.utils import logging as diffusers_logging

    # diffusers warns about dtype casts and a missing `accelerate` that do not apply here.
    diffusers_logging.set_verbosity_error()
    unet = _load_unet(root / UNET_CONFIG, root / UNET_WEIGHTS, placement)
    if unet.config.in_channels != 8 or unet.config.cross_attention_dim != AUDIO_DIM:
        raise WeightsError(
            f"{root / UNET_CONFIG}: a MuseTalk UNet takes 8 channels and 384-wide audio, this one "
            f"{unet.config.in_channels} and {unet.config.cross_attention_dim}"
        )
    vae = _load_vae(root / VAE_DIR, placement)
    encoder, extractor = _load_whisper(root / WHISPER_DIR, placement)
    scale = float(getattr(vae.config, "scaling_factor", None) or LATENT_SCALE)
    pe = PositionalEncoding().to(placement.device)
    logger.info("MuseTalk loaded from %s on %s", root, placement)
    return MuseTalkModels(unet, vae, encoder, extractor, pe, placement, scale, root)
