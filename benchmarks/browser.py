"""Headless Chromium for the browser tests, and an in-page A/V sync probe.

The probe measures what the call page presents, both sides on the page's performance.now()
clock:

- video: every frame the <video> element presents (requestVideoFrameCallback), timed by
  ``metadata.expectedDisplayTime``, the compositor's estimate of when the frame is shown
  (performance.now() clock). Its *mouth motion* is the mean absolute difference of the mouth box
  against the previous frame, read back through a canvas.
- audio: the element's MediaStream tapped with WebAudio (MediaStreamSource -> AudioWorklet),
  RMS per 128-sample render quantum stamped with the quantum's context frame. Context time goes
  to performance.now() through ``AudioContext.getOutputTimestamp()``, which places a context
  time at the instant WebAudio's *own* output plays it (render ahead + baseLatency +
  outputLatency). What the viewer hears is the element's output, which is earlier than that,
  so :func:`calibrate_audio_path` measures the difference on this call:
  WebAudio's lead over its output (``currentTime`` minus ``getOutputTimestamp().contextTime``),
  the MediaStreamSource FIFO wait (RTP audio level per packet from
  ``getSynchronizationSources()``, stamped when the element pulls the packet for playout,
  cross-correlated with the tapped RMS), and the element's sink delay (``media-playout``
  totalPlayoutDelay / totalSamplesCount).

The offset is the best lag of the cross-correlation of mouth motion with the absolute change of
the 40 ms audio envelope: positive means the audio is heard after the video.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from playwright.async_api import Page, async_playwright

CHROMIUM = Path("/usr/bin/chromium")

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--allow-loopback-in-peer-connection",
    "--autoplay-policy=no-user-gesture-required",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
]

F64 = npt.NDArray[np.float64]
Json = dict[str, Any]


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} is missing (Debian package 'chromium'; `make test` installs it)"
    return None


@asynccontextmanager
async def chromium_page(
    user_data_dir: Path, extra_args: Sequence[str] = (), *, bypass_csp: bool = False
) -> AsyncIterator[Page]:
    """A page in a fresh headless Chromium profile that may capture and play audio.

    ``bypass_csp``: for a page the sync probe goes into (install_sync_probe): its audio
    worklet is a ``blob:`` script, which the pages' Content-Security-Policy refuses."""
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=str(CHROMIUM),
            headless=True,
            args=[*CHROMIUM_ARGS, *extra_args],
            # Playwright mutes audio by default; the remote audio must play to be measured.
            ignore_default_args=["--mute-audio"],
            bypass_csp=bypass_csp,
        )
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            yield page
        finally:
            await context.close()


# --------------------------------------------------------------------------------------------
# Driving the call page


def with_test_hooks(url: str) -> str:
    """``url`` with ``testHooks`` in its query: the call page then exposes window.avatarCall
    (the page does not otherwise)."""
    return url + ("&" if "?" in url else "?") + "testHooks=1"


async def start_call(
    page: Page, url: str, *, timeout_s: float = 20.0, navigate: bool = True
) -> str:
    """Open the call page, press Start, wait until the avatar plays; returns the session id."""
    if navigate:
        await page.goto(with_test_hooks(url))
    await page.get_by_role("button", name="Start").click()
    await page.wait_for_function(
        "() => window.avatarCall?.sessionId && window.avatarCall.channel?.readyState === 'open'",
        timeout=timeout_s * 1000,
    )
    await page.evaluate("() => window.avatarCall.playing")
    session_id = await page.evaluate("() => window.avatarCall.sessionId")
    if not isinstance(session_id, str):
        raise RuntimeError(f"the page has no session id: {session_id!r}")
    return session_id


async def say_from_page(page: Page, text: str) -> None:
    """Type ``text`` into the page's text box and press Send."""
    await page.get_by_label("Text for the avatar to say").fill(text)
    await page.get_by_role("button", name="Send").click()


async def wait_for_state(page: Page, state: str, *, timeout_s: float = 20.0) -> None:
    """Wait for the last state event of the call to be ``state``."""
    await page.wait_for_function(
        "(state) => window.avatarCall.state === state", arg=state, timeout=timeout_s * 1000
    )


async def page_now(page: Page) -> float:
    """performance.now() of the page, ms."""
    now: float = await page.evaluate("() => performance.now()")
    return now


async def call_stats(page: Page) -> Json:
    """inbound-rtp per kind (with the codec's mimeType), media-playout and remote-outbound-rtp."""
    stats: Json = await page.evaluate(
        """async () => {
          const report = await window.avatarCall.pc.getStats();
          const out = { senderReports: {} };
          report.forEach((s) => {
            if (s.type === "inbound-rtp") {
              out[s.kind] = { ...s, mimeType: report.get(s.codecId)?.mimeType ?? null };
            } else if (s.type === "media-playout") {
              out.playout = { ...s };
            } else if (s.type === "remote-outbound-rtp") {
              out.senderReports[s.kind] = s.reportsSent ?? 0;
            }
          });
          return out;
        }"""
    )
    return stats


async def wait_for_sender_reports(page: Page, count: int, *, timeout_s: float = 15.0) -> None:
    """Wait until the browser has ``count`` RTCP sender reports for both audio and video.

    Chromium's lip-sync maps each stream's RTP time to NTP from these; before it has two per
    stream it cannot align the streams at all.
    """
    await page.wait_for_function(
        """async (count) => {
          const report = await window.avatarCall.pc.getStats();
          const sent = {};
          report.forEach((s) => {
            if (s.type === "remote-outbound-rtp") sent[s.kind] = s.reportsSent ?? 0;
          });
          return (sent.audio ?? 0) >= count && (sent.video ?? 0) >= count;
        }""",
        arg=count,
        timeout=timeout_s * 1000,
        polling=200,
    )


SETTLE_AUDIO_BUFFER_JS = """
async ({ toleranceMs, timeoutMs }) => {
  const audioStats = async () => {
    const report = await window.avatarCall.pc.getStats();
    let audio = null;
    report.forEach((s) => { if (s.type === "inbound-rtp" && s.kind === "audio") audio = s; });
    return audio;
  };
  const started = performance.now();
  let previous = await audioStats();
  let calm = 0;
  const history = [];
  while (performance.now() - started < timeoutMs) {
    await new Promise((resolve) => setTimeout(resolve, 500));
    const current = await audioStats();
    if (!current || !previous) {
      previous = current; // no audio received yet (it starts after the video)
      continue;
    }
    const emitted = current.jitterBufferEmittedCount - previous.jitterBufferEmittedCount;
    if (emitted > 0) {
      const delay = (current.jitterBufferDelay - previous.jitterBufferDelay) / emitted;
      const target = (current.jitterBufferTargetDelay - previous.jitterBufferTargetDelay) / emitted;
      history.push([Math.round(delay * 1000), Math.round(target * 1000)]);
      calm = (delay - target) * 1000 <= toleranceMs ? calm + 1 : 0;
      if (calm >= 2) return { settled: true, waitedMs: performance.now() - started, history };
    }
    previous = current;
  }
  return { settled: false, waitedMs: performance.now() - started, history };
}
"""


async def wait_for_audio_buffer_to_settle(
    page: Page, *, tolerance_ms: float = 25.0, timeout_s: float = 15.0
) -> Json:
    """Wait until the audio jitter buffer holds about its own target delay for a second.

    "About": with 20 ms packets pulled 10 ms at a time, a steady buffer sits 10-20 ms above
    jitterBufferTargetDelay (36 ms against a 20 ms target here).

    A stall while a call starts (here: the server's first second shares two cores with
    Chromium starting up) leaves NetEq holding 60-150 ms of audio where its target is 30-40 ms;
    it drains only by time-stretching, about 10 ms per second, and Chromium's lip-sync follows
    it with seconds of lag. Returns {settled, waitedMs, history: [[delay, target] ms, ...]}.
    """
    result: Json = await page.evaluate(
        SETTLE_AUDIO_BUFFER_JS, {"toleranceMs": tolerance_ms, "timeoutMs": timeout_s * 1000}
    )
    return result


# --------------------------------------------------------------------------------------------
# The A/V sync probe (runs in the page)

SYNC_PROBE_JS = r"""
async ({ mouthBox }) => {
  const call = window.avatarCall;
  const video = document.getElementById("remote");
  const [bx, by, bw, bh] = mouthBox;
  const timers = [];

  // Video: mouth motion of every presented frame.
  const canvas = document.createElement("canvas");
  canvas.width = bw;
  canvas.height = bh;
  const g2d = canvas.getContext("2d", { willReadFrequently: true });
  const frames = [];
  let previous = null;
  let running = true;
  const onFrame = (now, meta) => {
    if (!running) return;
    g2d.drawImage(video, bx, by, bw, bh, 0, 0, bw, bh);
    const pixels = g2d.getImageData(0, 0, bw, bh).data;
    let motion = null;
    if (previous) {
      let sum = 0;
      for (let i = 0; i < pixels.length; i += 4) {
        sum += Math.abs(pixels[i] - previous[i]) + Math.abs(pixels[i + 1] - previous[i + 1])
          + Math.abs(pixels[i + 2] - previous[i + 2]);
      }
      motion = sum / (0.75 * pixels.length);
    }
    previous = pixels;
    frames.push({
      expected: meta.expectedDisplayTime,
      presented: meta.presentedFrames,
      received: meta.receiveTime ?? null,
      motion,
    });
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);

  // Audio: RMS per render quantum of the element's stream, keyed by context frame.
  const worklet = `
    class RmsProbe extends AudioWorkletProcessor {
      constructor() { super(); this.batch = []; }
      process(inputs) {
        const channel = inputs[0][0];
        let sum = 0;
        if (channel) for (let i = 0; i < channel.length; i++) sum += channel[i] * channel[i];
        this.batch.push(currentFrame, channel ? Math.sqrt(sum / channel.length) : 0);
        if (this.batch.length >= 64) { this.port.postMessage(this.batch); this.batch = []; }
        return true;
      }
    }
    registerProcessor("rms-probe", RmsProbe);`;
  const ctx = new AudioContext({ latencyHint: "interactive" });
  const moduleUrl = URL.createObjectURL(new Blob([worklet], { type: "text/javascript" }));
  await ctx.audioWorklet.addModule(moduleUrl);
  const source = ctx.createMediaStreamSource(video.srcObject);
  const tap = new AudioWorkletNode(ctx, "rms-probe");
  const mute = ctx.createGain();
  mute.gain.value = 0;
  source.connect(tap).connect(mute).connect(ctx.destination);
  await ctx.resume();
  const blocks = [];
  tap.port.onmessage = (event) => { blocks.push(...event.data); };

  // Context time <-> performance.now(), sampled throughout.
  const clock = [];
  const sampleClock = () => {
    const ts = ctx.getOutputTimestamp();
    clock.push({ context: ts.contextTime, performance: ts.performanceTime,
      current: ctx.currentTime });
  };
  timers.push(setInterval(sampleClock, 50));

  // The element's own audio path: when each RTP packet was pulled for playout, and its level.
  const receiver = call.pc.getReceivers().find((r) => r.track.kind === "audio");
  const sources = [];
  let lastRtp = null;
  timers.push(setInterval(() => {
    for (const s of receiver.getSynchronizationSources()) {
      if (s.rtpTimestamp !== lastRtp && s.audioLevel !== undefined) {
        lastRtp = s.rtpTimestamp;
        sources.push({ timestamp: s.timestamp, level: s.audioLevel });
      }
    }
  }, 4));

  // Jitter buffers over time, to explain the offset: inbound-rtp cumulative counters.
  const trace = [];
  timers.push(setInterval(async () => {
    const report = await call.pc.getStats();
    const row = { now: performance.now() };
    report.forEach((s) => {
      if (s.type === "inbound-rtp") {
        row[s.kind] = { delay: s.jitterBufferDelay, emitted: s.jitterBufferEmittedCount };
      }
    });
    trace.push(row);
  }, 250));

  window.avSyncProbe = {
    async stop() {
      running = false;
      timers.forEach(clearInterval);
      sampleClock();
      source.disconnect();
      await ctx.close();
      return {
        frames, blocks, clock, sources, trace,
        sampleRate: ctx.sampleRate,
        baseLatency: ctx.baseLatency,
        outputLatency: ctx.outputLatency ?? null,
        timeOrigin: performance.timeOrigin,
      };
    },
  };
}
"""


async def install_sync_probe(page: Page, mouth_box: Sequence[int]) -> None:
    """Start recording; ``mouth_box`` is (x, y, w, h) in video pixels."""
    await page.evaluate(SYNC_PROBE_JS, {"mouthBox": list(mouth_box)})


async def collect_sync_probe(page: Page) -> Json:
    """Stop recording and return what the probe saw."""
    probe: Json = await page.evaluate("() => window.avSyncProbe.stop()")
    return probe


# --------------------------------------------------------------------------------------------
# Analysis

ENVELOPE_MS = 40.0
"""Audio envelope window: one video frame at 25 fps."""
PACKET_MS = 20.0
"""Audio per RTP packet (aiortc's Opus ptime)."""


@dataclass(frozen=True)
class AudioPath:
    """Where the tapped audio sits against what the <video> element plays, in ms."""

    output_lead_ms: float
    """WebAudio renders this far ahead of its own output (baseLatency + outputLatency)."""
    tap_delay_ms: float
    """From the element pulling a packet for playout to WebAudio rendering it (the FIFO)."""
    tap_peak: float
    """Correlation of per-packet RTP audio level with the tapped RMS at ``tap_delay_ms``."""
    playout_ms: float
    """The element's own sink delay (media-playout totalPlayoutDelay per sample)."""

    @property
    def correction_ms(self) -> float:
        """Add to a WebAudio output time to get the time the element's audio is heard."""
        return self.playout_ms - self.output_lead_ms - self.tap_delay_ms


@dataclass(frozen=True)
class SyncEstimate:
    offset_ms: float
    """Best lag: positive when the audio is heard after the video it belongs to."""
    peak: float
    """Pearson correlation at the best lag."""
    frames: int
    """Video frames used."""


def audio_output_ms(probe: Json) -> tuple[F64, F64]:
    """(performance.now() ms when WebAudio's output plays it, RMS) per tapped render quantum."""
    blocks = np.asarray(probe["blocks"], dtype=np.float64).reshape(-1, 2)
    pairs = [(c["context"], c["performance"]) for c in probe["clock"] if c["performance"] > 0]
    clock = np.asarray(pairs, dtype=np.float64)
    # performanceTime = contextTime * 1000 + shift: both clocks keep the same rate here (the
    # spread of the shift over a call is under 0.3 ms), so the median shift is the mapping.
    shift = float(np.median(clock[:, 1] - clock[:, 0] * 1000.0))
    middle_s = (blocks[:, 0] + 64) / float(probe["sampleRate"])  # RMS of a 128-frame quantum
    return middle_s * 1000.0 + shift, blocks[:, 1]


def window_rms(times_ms: F64, rms: F64, start_ms: F64, width_ms: float) -> F64:
    """RMS over [start, start + width) of a signal given as RMS per evenly spaced block."""
    step = float(np.median(np.diff(times_ms)))
    edges = np.concatenate([times_ms - step / 2, [times_ms[-1] + step / 2]])
    energy = np.concatenate([[0.0], np.cumsum(rms**2)])
    begin = np.interp(start_ms, edges, energy)
    end = np.interp(start_ms + width_ms, edges, energy)
    result: F64 = np.sqrt(np.maximum(end - begin, 0.0) * step / width_ms)
    return result


def envelope_change(times_ms: F64, rms: F64, at_ms: F64, window_ms: float = ENVELOPE_MS) -> F64:
    """|E[t, t+w) - E[t-w, t)| at each ``at_ms``, E being the RMS over the window.

    Frame k shows the mouth for the audio heard during [t_k, t_k + 1/fps); its motion against
    frame k-1 goes with this change of the envelope across t_k.
    """
    after = window_rms(times_ms, rms, at_ms, window_ms)
    before = window_rms(times_ms, rms, at_ms - window_ms, window_ms)
    return np.abs(after - before)


def calibrate_audio_path(probe: Json, stats: Json) -> AudioPath:
    """Measure, on this call, how the WebAudio tap relates to the element's audio output."""
    lead_s = [c["current"] - c["context"] for c in probe["clock"]]
    output_lead_ms = 1000.0 * float(np.median(lead_s))
    playout = stats["playout"]
    playout_ms = 1000.0 * playout["totalPlayoutDelay"] / playout["totalSamplesCount"]

    # RTCRtpSynchronizationSource.timestamp is wall-clock ms in Chromium: to performance.now().
    pulled_ms = np.asarray([s["timestamp"] for s in probe["sources"]]) - probe["timeOrigin"]
    level = np.asarray([s["level"] for s in probe["sources"]], dtype=np.float64)
    out_ms, rms = audio_output_ms(probe)
    render_ms = out_ms - output_lead_ms
    best_lag, best_r = 0.0, -1.0
    for lag in np.arange(-40.0, 80.0, 0.5):
        inside = (pulled_ms + lag > render_ms[0]) & (pulled_ms + lag + PACKET_MS < render_ms[-1])
        tapped = window_rms(render_ms, rms, pulled_ms[inside] + lag, PACKET_MS)
        r = float(np.corrcoef(level[inside], tapped)[0, 1])
        if r > best_r:
            best_lag, best_r = float(lag), r
    return AudioPath(output_lead_ms, best_lag, best_r, playout_ms)


def video_motion(probe: Json) -> tuple[F64, F64]:
    """(expectedDisplayTime ms, mouth motion) of frames presented right after the previous one.

    A frame the compositor skipped would fold two frames' motion into one sample.
    """
    frames = probe["frames"]
    kept = [
        (cur["expected"], cur["motion"])
        for prev, cur in zip(frames, frames[1:], strict=False)
        if cur["motion"] is not None and cur["presented"] - prev["presented"] == 1
    ]
    table = np.asarray(kept, dtype=np.float64).reshape(-1, 2)
    return table[:, 0], table[:, 1]


def estimate_offset(
    video_ms: F64,
    motion: F64,
    audio_ms: F64,
    rms: F64,
    *,
    max_lag_ms: float = 200.0,
    step_ms: float = 1.0,
) -> SyncEstimate:
    """Best lag between mouth motion and the audio envelope's change (Pearson, 1 ms steps)."""
    margin = max_lag_ms + ENVELOPE_MS
    inside = (video_ms - margin > audio_ms[0]) & (video_ms + margin < audio_ms[-1])
    t, m = video_ms[inside], motion[inside]
    if len(t) < 10 or m.std() == 0:
        return SyncEstimate(float("nan"), 0.0, len(t))
    m = (m - m.mean()) / m.std()
    best = SyncEstimate(float("nan"), -1.0, len(t))
    for lag in np.arange(-max_lag_ms, max_lag_ms + step_ms / 2, step_ms):
        a = envelope_change(audio_ms, rms, t + lag)
        if a.std() == 0:
            continue
        r = float(np.mean(m * (a - a.mean()) / a.std()))
        if r > best.peak:
            best = SyncEstimate(float(lag), r, len(t))
    return best


def mean_delay_ms(trace: list[Json], kind: str, start_ms: float, end_ms: float) -> float:
    """Mean jitter-buffer delay per emitted sample/frame of ``kind`` between two instants."""
    rows = [r for r in trace if kind in r and start_ms <= r["now"] <= end_ms]
    if len(rows) < 2 or rows[-1][kind]["emitted"] == rows[0][kind]["emitted"]:
        return float("nan")
    delay = float(rows[-1][kind]["delay"] - rows[0][kind]["delay"])
    return 1000.0 * delay / float(rows[-1][kind]["emitted"] - rows[0][kind]["emitted"])


def video_display_ms(probe: Json, start_ms: float, end_ms: float) -> float:
    """Median video frame arrival (last packet) -> expected display, between two instants."""
    delays = [
        f["expected"] - f["received"]
        for f in probe["frames"]
        if f["received"] is not None and start_ms <= f["expected"] <= end_ms
    ]
    return float(np.median(delays)) if delays else float("nan")


@dataclass(frozen=True)
class WindowSync:
    """The offset over one stretch of the call, and the browser's buffering behind it."""

    estimate: SyncEstimate
    audio_buffer_ms: float
    """Audio jitter-buffer delay (packet arrival -> pulled for playout), mean."""
    video_display_ms: float
    """Video frame arrival -> expected display, median."""
    playout_ms: float
    """The element's audio sink delay."""

    @property
    def wire_ms(self) -> float:
        """The offset without the browser's buffering: audio arrival minus video arrival for
        one media instant, which is what the server put on the wire (plus loopback)."""
        audio_path = self.audio_buffer_ms + self.playout_ms
        return self.estimate.offset_ms - audio_path + self.video_display_ms

    def summary(self) -> str:
        return (
            f"{self.estimate.offset_ms:+.0f} ms (r {self.estimate.peak:.2f}, "
            f"{self.estimate.frames} frames; audio buffer {self.audio_buffer_ms:.0f} "
            f"+ sink {self.playout_ms:.0f}, video arrival->display {self.video_display_ms:.0f}, "
            f"wire {self.wire_ms:+.0f})"
        )


@dataclass(frozen=True)
class SyncReport:
    heard: WindowSync
    """Element audio as heard against displayed video, whole measurement: the A/V offset."""
    webaudio: SyncEstimate
    """The same against WebAudio's own output clock, uncorrected (for comparison)."""
    path: AudioPath
    segments: list[WindowSync]
    """One per spoken text."""

    def summary(self) -> str:
        per_say = "; ".join(s.summary() for s in self.segments)
        return (
            f"A/V offset (audio heard - video shown) {self.heard.summary()}; "
            f"per say: {per_say}; uncorrected WebAudio-output clock "
            f"{self.webaudio.offset_ms:+.0f} ms; tap FIFO {self.path.tap_delay_ms:.1f} ms "
            f"(r {self.path.tap_peak:.3f}), WebAudio lead {self.path.output_lead_ms:.1f} ms"
        )


def measure_sync(
    probe: Json, stats: Json, segments: Sequence[tuple[float, float]] = ()
) -> SyncReport:
    """The A/V offset of a probed call; ``segments`` are (start, end) performance.now() ms."""
    path = calibrate_audio_path(probe, stats)
    video_ms, motion = video_motion(probe)
    out_ms, rms = audio_output_ms(probe)
    heard_ms = out_ms + path.correction_ms

    def window(start: float, end: float) -> WindowSync:
        inside = (video_ms >= start) & (video_ms <= end)
        return WindowSync(
            estimate_offset(video_ms[inside], motion[inside], heard_ms, rms),
            mean_delay_ms(probe["trace"], "audio", start, end),
            video_display_ms(probe, start, end),
            path.playout_ms,
        )

    return SyncReport(
        heard=window(float(video_ms[0]), float(video_ms[-1])),
        webaudio=estimate_offset(video_ms, motion, out_ms, rms),
        path=path,
        segments=[window(start, end) for start, end in segments],
    )
