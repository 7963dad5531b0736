"""avatar-rtc's media server."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("avatar-rtc")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
