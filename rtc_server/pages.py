"""Where the pages are: ``static/`` (scripts, styles, the call page) and ``templates/`` (pages
filled in per request) sit at the top of a source checkout; installed from a wheel they are
inside the package (``pyproject.toml`` maps them to ``rtc_server/static`` and
``rtc_server/templates``)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def page_dir(name: str) -> Path:
    installed = Path(str(resources.files("rtc_server"))) / name
    if installed.is_dir():
        return installed
    checkout = Path(__file__).resolve().parents[1] / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"no {name}/ in the package ({installed}) or the checkout ({checkout})")


STATIC_DIR = page_dir("static")
TEMPLATES_DIR = page_dir("templates")
