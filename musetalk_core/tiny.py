"""Random-weight MuseTalk releases in the real on-disk layout, for tests and CPU benchmarks.

The real weights cannot be downloaded on machines without the hub, so tests build a release
here and load it through the real loading code (:func:`musetalk_core.models.load_models`).
``tiny`` keeps every interface dimension of the real models (8-channel UNet input, 4x32x32
latents, 384-wide cross-attention, a five-hidden-state whisper encoder of width 384 over 30 s,
256x256 VAE images) and shrinks only the insides; ``full`` is the real architecture (UNet
850 M parameters, sd-vae-ft-mse shape, whisper-tiny) with random values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch

from .vae_keys import published_keys
from .weights import UNET_CONFIG, UNET_WEIGHTS, VAE_DIR, WHISPER_DIR, write_manifest

__all__ = ["UNET_FULL", "UNET_TINY", "build_random_weights"]

Size = Literal["tiny", "full"]

UNET_FULL: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0.dev0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 384,
    "down_block_types": [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 8,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": [
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ],
}
"""MuseTalk 1.5's ``musetalk.json`` (as published; check it against a real download)."""

UNET_TINY: dict[str, Any] = {
    **UNET_FULL,
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "sample_size": 32,
}

_VAE_FULL: dict[str, Any] = {
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "norm_num_groups": 32,
}
_VAE_TINY: dict[str, Any] = {
    "block_out_channels": (8, 16, 32, 32),
    "layers_per_block": 1,
    "norm_num_groups": 8,
}
_WHISPER_FULL: dict[str, Any] = {"encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536}
_WHISPER_TINY: dict[str, Any] = {"encoder_ffn_dim": 256, "decoder_ffn_dim": 64}


def build_random_weights(
    root: str | os.PathLike[str], size: Size = "tiny", *, seed: int = 0
) -> Path:
    """Write a random-weight release under ``root`` (created) and return it."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    base = Path(root)
    torch.manual_seed(seed)
    unet_config = UNET_TINY if size == "tiny" else UNET_FULL
    (base / UNET_CONFIG).parent.mkdir(parents=True, exist_ok=True)
    (base / UNET_CONFIG).write_text(json.dumps(unet_config, indent=2))
    unet = UNet2DConditionModel.from_config(unet_config)
    torch.save(unet.state_dict(), base / UNET_WEIGHTS)
    del unet

    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        sample_size=256,
        scaling_factor=0.18215,
        **(_VAE_TINY if size == "tiny" else _VAE_FULL),
    )
    vae_dir = base / VAE_DIR
    vae_dir.mkdir(parents=True, exist_ok=True)
    vae.save_config(vae_dir)
    # In the published names, as sd-vae-ft-mse is: a loader that cannot read the real file
    # cannot read this one either.
    torch.save(published_keys(vae.state_dict()), vae_dir / "diffusion_pytorch_model.bin")
    del vae

    whisper_config = WhisperConfig(
        vocab_size=51865 if size == "full" else 64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        num_mel_bins=80,
        d_model=384,
        encoder_layers=4,
        decoder_layers=4 if size == "full" else 1,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        max_source_positions=1500,
        max_target_positions=448,
        **(_WHISPER_TINY if size == "tiny" else _WHISPER_FULL),
    )
    whisper = WhisperForConditionalGeneration(whisper_config)
    whisper_dir = base / WHISPER_DIR
    whisper_dir.mkdir(parents=True, exist_ok=True)
    whisper_config.save_pretrained(whisper_dir)
    # The release ships the checkpoint as pytorch_model.bin; keep that form.
    # The output projection is tied to the token embedding and is not stored.
    state = {k: v.contiguous() for k, v in whisper.state_dict().items() if k != "proj_out.weight"}
    torch.save(state, whisper_dir / "pytorch_model.bin")
    WhisperFeatureExtractor(feature_size=80).save_pretrained(whisper_dir)
    del whisper
    write_manifest(base)
    return base
