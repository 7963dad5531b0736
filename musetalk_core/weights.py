"""Where MuseTalk 1.5's weights live on disk, how they are fetched, and how they are checked.

The layout is the one of the published release as its own download script lays it out, so a
directory made by upstream's ``download_weights.sh`` works here unchanged::

    WEIGHTS/
      musetalkV15/musetalk.json        UNet2DConditionModel config   (TMElyralab/MuseTalk)
      musetalkV15/unet.pth             UNet state dict               (TMElyralab/MuseTalk)
      sd-vae/config.json               AutoencoderKL, diffusers folder (stabilityai/sd-vae-ft-mse)
      sd-vae/diffusion_pytorch_model.bin   (or .safetensors)
      whisper/config.json              whisper-tiny, transformers folder (openai/whisper-tiny)
      whisper/pytorch_model.bin            (or model.safetensors)
      whisper/preprocessor_config.json
      manifest.json                    ours: size and SHA-256 of every file, written on download

Checksums: the hub publishes the SHA-256 of every LFS file and the git blob id of every small
one; :func:`download_weights` checks each downloaded file against them and records the SHA-256
in ``manifest.json``. :func:`check_layout` (run at every load) checks presence and sizes against
the manifest, which is cheap; :func:`verify_weights` rehashes everything.

Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .types import AvatarRtcError

__all__ = [
    "DEFAULT_WEIGHTS_DIR",
    "FILES",
    "WeightFile",
    "WeightsError",
    "check_layout",
    "download_weights",
    "verify_weights",
    "weights_id",
]

DEFAULT_WEIGHTS_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "avatar-rtc/musetalk"
)
MANIFEST = "manifest.json"
UNET_CONFIG = "musetalkV15/musetalk.json"
UNET_WEIGHTS = "musetalkV15/unet.pth"
VAE_DIR = "sd-vae"
WHISPER_DIR = "whisper"


class WeightsError(AvatarRtcError, RuntimeError):
    """The weights directory is missing, incomplete or corrupt; the message says which file."""


@dataclass(frozen=True, slots=True)
class WeightFile:
    """One file of the release: where it lives locally and where it comes from."""

    local: str
    """Path inside the weights directory."""
    repo_id: str
    """Hugging Face repository it is downloaded from."""
    remote: str
    """Path inside that repository."""
    alternatives: tuple[str, ...] = ()
    """Other local names accepted instead (e.g. the safetensors form of the same weights)."""


FILES: tuple[WeightFile, ...] = (
    WeightFile(UNET_CONFIG, "TMElyralab/MuseTalk", "musetalkV15/musetalk.json"),
    WeightFile(UNET_WEIGHTS, "TMElyralab/MuseTalk", "musetalkV15/unet.pth"),
    WeightFile(f"{VAE_DIR}/config.json", "stabilityai/sd-vae-ft-mse", "config.json"),
    WeightFile(
        f"{VAE_DIR}/diffusion_pytorch_model.bin",
        "stabilityai/sd-vae-ft-mse",
        "diffusion_pytorch_model.bin",
        alternatives=(f"{VAE_DIR}/diffusion_pytorch_model.safetensors",),
    ),
    WeightFile(f"{WHISPER_DIR}/config.json", "openai/whisper-tiny", "config.json"),
    WeightFile(
        f"{WHISPER_DIR}/pytorch_model.bin",
        "openai/whisper-tiny",
        "pytorch_model.bin",
        alternatives=(f"{WHISPER_DIR}/model.safetensors",),
    ),
    WeightFile(
        f"{WHISPER_DIR}/preprocessor_config.json", "openai/whisper-tiny", "preprocessor_config.json"
    ),
)


def _present(root: Path, wf: WeightFile) -> Path | None:
    for name in (wf.local, *wf.alternatives):
        if (root / name).is_file():
            return root / name
    return None


def _manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("files", {}), dict):
        raise WeightsError(f"{path} is not a weights manifest")
    files: dict[str, Any] = data.get("files", {})
    return files


def check_layout(root: str | os.PathLike[str]) -> dict[str, Path]:
    """Every file of the release is present (and of its recorded size); their paths by name.

    Raises :class:`WeightsError` naming the first missing or truncated file.
    """
    base = Path(root)
    if not base.is_dir():
        raise WeightsError(f"no MuseTalk weights directory at {base} (avatar-rtc download-weights)")
    recorded = _manifest(base)
    found: dict[str, Path] = {}
    for wf in FILES:
        path = _present(base, wf)
        if path is None:
            raise WeightsError(f"MuseTalk weights incomplete: {base / wf.local} is missing")
        rel = path.relative_to(base).as_posix()
        entry = recorded.get(rel)
        if isinstance(entry, dict) and entry.get("size") != path.stat().st_size:
            raise WeightsError(
                f"{path} is {path.stat().st_size} bytes, the manifest says {entry.get('size')}: "
                "truncated or replaced (avatar-rtc download-weights)"
            )
        found[wf.local] = path
    return found


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def git_blob_id(path: Path) -> str:
    """The git object id of a file's content (how the hub names small, non-LFS files)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def verify_weights(root: str | os.PathLike[str]) -> list[str]:
    """Rehash every file against ``manifest.json``; the problems found (empty when sound)."""
    base = Path(root)
    try:
        found = check_layout(base)
    except WeightsError as exc:
        return [str(exc)]
    recorded = _manifest(base)
    if not recorded:
        return [f"{base / MANIFEST} is missing: nothing to verify against"]
    problems = []
    for path in found.values():
        rel = path.relative_to(base).as_posix()
        entry = recorded.get(rel)
        if not isinstance(entry, dict) or "sha256" not in entry:
            problems.append(f"{rel}: not in the manifest")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"{rel}: SHA-256 differs from the manifest")
    return problems


def weights_id(root: str | os.PathLike[str]) -> str:
    """A short identity of the weights (for avatar caches): their manifest, or names and sizes."""
    base = Path(root)
    found = check_layout(base)
    digest = hashlib.sha256()
    for name in sorted(found):
        path = found[name]
        digest.update(f"{name}:{path.stat().st_size}:{int(path.stat().st_mtime)}\n".encode())
    manifest = base / MANIFEST
    if manifest.exists():
        digest.update(manifest.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class RemoteInfo:
    """What the hub says a file should be."""

    size: int | None
    sha256: str | None
    """Set for LFS files."""
    blob_id: str | None
    """Set for every file: the git object id."""


InfoFn = Callable[[str, list[str]], dict[str, RemoteInfo]]
FetchFn = Callable[[str, str, Path], Path]


def _hub_info(repo_id: str, paths: list[str]) -> dict[str, RemoteInfo]:
    from huggingface_hub import HfApi

    out: dict[str, RemoteInfo] = {}
    for item in HfApi().get_paths_info(repo_id, paths):
        lfs = getattr(item, "lfs", None)
        out[item.path] = RemoteInfo(
            size=getattr(item, "size", None),
            sha256=getattr(lfs, "sha256", None) if lfs is not None else None,
            blob_id=getattr(item, "blob_id", None),
        )
    return out


def _hub_fetch(repo_id: str, remote: str, target: Path) -> Path:
    """Download one file to ``target`` (through a temporary name in the same directory)."""
    import shutil
    import tempfile

    from huggingface_hub import hf_hub_download

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        got = Path(hf_hub_download(repo_id, remote, local_dir=tmp))
        shutil.move(got, target.with_suffix(target.suffix + ".part"))
    return target.with_suffix(target.suffix + ".part")


def download_weights(
    root: str | os.PathLike[str],
    *,
    files: Iterable[WeightFile] = FILES,
    info: InfoFn = _hub_info,
    fetch: FetchFn = _hub_fetch,
    log: Callable[[str], None] = print,
) -> Path:
    """Fetch the release into ``root``, check every file against the hub's checksums, and
    write ``manifest.json``. Files already present with the right checksum are kept.

    ``info`` and ``fetch`` default to the Hugging Face hub (huggingface_hub); they are
    parameters so the checking logic can be exercised without the network.
    """
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    wanted = list(files)
    by_repo: dict[str, list[WeightFile]] = {}
    for wf in wanted:
        by_repo.setdefault(wf.repo_id, []).append(wf)
    manifest: dict[str, dict[str, Any]] = {}
    for repo_id, group in by_repo.items():
        remote = info(repo_id, [wf.remote for wf in group])
        for wf in group:
            expected = remote.get(wf.remote)
            if expected is None:
                raise WeightsError(f"{repo_id} has no file {wf.remote}")
            target = base / wf.local
            if target.exists() and _matches(target, expected):
                log(f"ok       {wf.local}")
            else:
                log(f"fetching {repo_id}/{wf.remote}")
                part = fetch(repo_id, wf.remote, target)
                if not _matches(part, expected):
                    part.unlink(missing_ok=True)
                    raise WeightsError(f"{repo_id}/{wf.remote}: checksum mismatch after download")
                os.replace(part, target)
            manifest[wf.local] = {
                "size": target.stat().st_size,
                "sha256": sha256_file(target),
                "source": f"{repo_id}/{wf.remote}",
            }
    tmp = base / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": manifest}, indent=2, sort_keys=True))
    os.replace(tmp, base / MANIFEST)
    return base


def _matches(path: Path, expected: RemoteInfo) -> bool:
    if expected.size is not None and path.stat().st_size != expected.size:
        return False
    if expected.sha256 is not None:
        return sha256_file(path) == expected.sha256
    if expected.blob_id is not None:
        return git_blob_id(path) == expected.blob_id
    return True


def write_manifest(root: str | os.PathLike[str]) -> None:
    """Record sizes and SHA-256 of the files present (for directories made by other means)."""
    base = Path(root)
    found = check_layout(base)
    entries = {
        p.relative_to(base).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in found.values()
    }
    (base / MANIFEST).write_text(json.dumps({"files": entries}, indent=2, sort_keys=True))
