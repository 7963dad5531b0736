"""Debian's Firefox ESR, driven through Marionette (Mozilla's own protocol; no geckodriver).

Marionette's client is blocking: the tests run it on a thread (``asyncio.to_thread``) while the
server runs on the test's event loop. Fake media (a generated tone for the microphone), no
permission prompts, autoplay allowed, ICE on loopback (run inside a network namespace holding
only ``lo``: nothing can leave the machine).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FIREFOX = Path("/usr/bin/firefox-esr")

PREFS: dict[str, Any] = {
    # Fake devices, no prompts, media plays without a gesture.
    "media.navigator.streams.fake": True,
    "media.navigator.permission.disabled": True,
    # Allowed by default: Firefox gathers ICE candidates beyond the default route's address
    # (there is none in a namespace holding only lo) only for a page that may capture.
    "permissions.default.microphone": 1,
    "permissions.default.camera": 1,
    "media.autoplay.default": 0,
    "media.autoplay.blocking_policy": 0,
    # ICE: loopback candidates (off by default), plain host addresses instead of mDNS names.
    "media.peerconnection.ice.loopback": True,
    "media.peerconnection.ice.obfuscate_host_addresses": False,
    # Nothing of its own on the network: no captive portal, connectivity or update checks.
    "network.captive-portal-service.enabled": False,
    "network.connectivity-service.enabled": False,
    "app.update.disabledForTesting": True,
    "browser.safebrowsing.update.enabled": False,
    "extensions.update.enabled": False,
    "datareporting.policy.dataSubmissionEnabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
}


def firefox_missing() -> str | None:
    """Why the Firefox tests cannot run here, or None when they can."""
    if not FIREFOX.exists():
        return f"{FIREFOX} is missing (Debian package 'firefox-esr'; `make test` installs it)"
    return None


@contextlib.contextmanager
def firefox(log: Path) -> Iterator[Any]:
    """A headless Firefox ESR with a fresh profile and a Marionette session on it."""
    from marionette_driver.marionette import Marionette

    client = Marionette(
        bin=str(FIREFOX),
        port=0,
        headless=True,
        prefs=PREFS,
        gecko_log=str(log),
        startup_timeout=120,
    )
    try:
        client.start_session()
        yield client
    finally:
        with contextlib.suppress(Exception):
            client.delete_session()
        client.cleanup()
        profile = client.profile_path
        if profile:
            shutil.rmtree(profile, ignore_errors=True)


def run(client: Any, script: str, *args: Any) -> Any:
    """Run ``script`` (a function body) in the page itself: Marionette's default sandbox sees
    the page through Xray wrappers, which hide what the page's own scripts set on window."""
    return client.execute_script(script, script_args=args, sandbox=None)


def wait_for(
    client: Any, script: str, timeout_s: float, what: str, args: tuple[Any, ...] = ()
) -> Any:
    """Run ``script`` (a function body that returns) every 0.1 s until it returns something
    truthy; that value. TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = run(client, script, *args)
        if value:
            return value
        if time.monotonic() > deadline:
            page = run(client, PAGE_STATE_JS)
            raise TimeoutError(f"Firefox: no {what} within {timeout_s:.0f} s; the page: {page}")
        time.sleep(0.1)


PAGE_STATE_JS = """
const call = window.avatarCall;
return { status: document.getElementById("status")?.textContent ?? null,
         state: call?.state ?? null, ice: call?.pc?.iceConnectionState ?? null,
         connection: call?.pc?.connectionState ?? null,
         channel: call?.channel?.readyState ?? null, events: call?.events?.slice(-5) ?? null };
"""


def click_button(client: Any, label: str) -> None:
    """Click the page's button whose text is ``label``."""
    found = run(
        client,
        """for (const b of document.querySelectorAll("button")) {
             if (b.textContent.trim() === arguments[0] && !b.disabled) { b.click(); return true; }
           }
           return false;""",
        label,
    )
    if not found:
        raise AssertionError(f"no enabled button {label!r} on the page")


VIDEO_FRAMES_JS = """
const done = arguments[arguments.length - 1];
const video = document.getElementById("remote");
window.avatarCall.pc.getStats().then((report) => {
  let decoded = null;
  let audio = null;
  report.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "video") decoded = s.framesDecoded;
    if (s.type === "inbound-rtp" && s.kind === "audio") audio = s;
  });
  done({ decoded, at: performance.now(), width: video.videoWidth, paused: video.paused,
         energy: audio?.totalAudioEnergy ?? null, duration: audio?.totalSamplesDuration ?? null,
         level: audio?.audioLevel ?? null, samples: audio?.totalSamplesReceived ?? null });
});
"""

INBOUND_JS = """
const done = arguments[arguments.length - 1];
window.avatarCall.pc.getStats().then((report) => {
  const out = {};
  report.forEach((s) => {
    if (s.type === "inbound-rtp") {
      out[s.kind] = { mimeType: report.get(s.codecId)?.mimeType ?? null,
                      framesDecoded: s.framesDecoded ?? null, packets: s.packetsReceived };
    }
  });
  done(out);
});
"""


def video_frames(client: Any) -> dict[str, Any]:
    """The video's frames decoded so far, when (page ms), its width and whether it plays."""
    frames: dict[str, Any] = client.execute_async_script(
        VIDEO_FRAMES_JS, script_timeout=10_000, sandbox=None
    )
    return frames


def inbound(client: Any) -> dict[str, Any]:
    """inbound-rtp per kind: the codec's mimeType, frames decoded, packets."""
    stats: dict[str, Any] = client.execute_async_script(
        INBOUND_JS, script_timeout=10_000, sandbox=None
    )
    return stats
