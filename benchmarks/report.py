"""One JSON schema for every benchmark, and the table printer."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA_VERSION = 1


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0]}


def versions() -> dict[str, str]:
    """Versions of the media stack; "not installed" on a machine that runs only the engine
    benchmark (the GPU check's bare image has neither aiortc nor PyAV)."""
    out = {}
    for name in ("aiortc", "av"):
        try:
            out[name] = str(__import__(name).__version__)
        except ImportError:
            out[name] = "not installed"
    return out | {"numpy": np.__version__}


def summary(samples: Sequence[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def write_json(path: Path, bench: str, settings: dict[str, Any], results: Any) -> None:
    doc = {
        "schema": SCHEMA_VERSION,
        "benchmark": bench,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "versions": versions(),
        "settings": settings,
        "results": results,
    }
    path.write_text(json.dumps(doc, indent=2))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [
        [f"{v:.2f}" if isinstance(v, float) else str(v) for v in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def progress(message: str) -> None:
    """A progress line on stderr, so tables and --json output stay clean."""
    print(f"  .. {message}", file=sys.stderr, flush=True)
