// The viseme stream example: a mouth drawn in the page from the server's viseme frames, played
// against the received audio (docs/ARCHITECTURE.md, "The viseme stream"). A client that draws
// its own avatar (three.js, Unity, an ARKit face) does the same three things:
//   1. decode each binary frame of the "visemes" data channel (decodeFrame);
//   2. keep them by RTP time, a later frame replacing an earlier one for the same time, and a
//      frame marked "cut" dropping every frame held from its time on (VisemeTrack.add);
//   3. at each animation frame, read the RTP time of the audio playing now from the audio
//      receiver's synchronization source, and show the newest frame at or before it (at).
//
// Test hook, for the browser tests only: with ?testHooks in the page's URL, window.visemeDemo
// has the Call (call), the VisemeTrack (track) and counters of what was drawn (drawn).

import { Call, takeUrlToken } from "./call.js";

// The blend shapes of the frames, in their order (rtc_server/viseme_stream.py BLEND_SHAPES).
export const BLEND_SHAPES = [
  "jawOpen",
  "mouthClose",
  "mouthFunnel",
  "mouthPucker",
  "mouthStretchLeft",
  "mouthStretchRight",
  "mouthSmileLeft",
  "mouthSmileRight",
  "mouthRollLower",
  "mouthRollUpper",
  "mouthPressLeft",
  "mouthPressRight",
  "mouthLowerDownLeft",
  "mouthLowerDownRight",
  "mouthUpperUpLeft",
  "mouthUpperUpRight",
  "tongueOut",
];
export const VISEMES = ["sil", "PP", "FF", "TH", "DD", "kk", "CH", "SS", "nn", "RR", "aa", "E", "ih", "oh", "ou"];
const AUDIO_RATE = 48000;
const FRAME_SAMPLES = 960; // one frame per 20 ms of audio
const HOLD_FRAMES = 250; // frames kept behind the playing one: 5 s

/** One binary frame: {samples, t, rtp, viseme, weights: {name: 0..1}, cut, end}. */
export function decodeFrame(buffer) {
  const view = new DataView(buffer);
  const count = view.getUint8(3);
  if (view.getUint8(0) !== 1 || count !== BLEND_SHAPES.length) throw new Error("not a version 1 viseme frame");
  const flags = view.getUint8(1);
  const weights = {};
  BLEND_SHAPES.forEach((name, i) => {
    weights[name] = view.getUint16(12 + 2 * i, true) / 1000;
  });
  const samples = view.getUint32(4, true);
  return {
    samples,
    t: samples / AUDIO_RATE,
    rtp: flags & 4 ? view.getUint32(8, true) : null,
    viseme: VISEMES[view.getUint8(2)],
    weights,
    cut: Boolean(flags & 1),
    end: Boolean(flags & 2),
  };
}

/** RTP time a minus b, wrap-aware (32 bits). */
function rtpDiff(a, b) {
  return ((a - b) | 0);
}

/** The frames of a call by RTP time, and the one that shapes a given instant. */
export class VisemeTrack {
  constructor() {
    this.frames = new Map();
    this.received = 0;
  }

  add(frame) {
    if (frame.rtp === null) return; // the server does not know the RTP clock yet
    this.received += 1;
    if (frame.cut) {
      for (const rtp of this.frames.keys()) if (rtpDiff(rtp, frame.rtp) >= 0) this.frames.delete(rtp);
    }
    this.frames.set(frame.rtp, frame);
  }

  /** The newest frame at or before RTP time `now`, and how far behind it is (samples). */
  at(now) {
    let best = null;
    let behind = Infinity;
    for (const [rtp, frame] of this.frames) {
      const d = rtpDiff(now, rtp);
      if (d >= 0 && d < behind) {
        best = frame;
        behind = d;
      } else if (d > HOLD_FRAMES * FRAME_SAMPLES) {
        this.frames.delete(rtp);
      }
    }
    // A rest frame shows rest from then on; anything else shapes its own 20 ms only.
    if (best && !best.end && behind >= 2 * FRAME_SAMPLES) return { frame: null, behind };
    return { frame: best, behind };
  }
}

/** The RTP time of the audio the browser plays now, or null before the first packet. */
export function playingRtp(pc) {
  const receiver = pc?.getReceivers().find((r) => r.track?.kind === "audio");
  const source = receiver?.getSynchronizationSources()[0];
  if (!source || source.rtpTimestamp === undefined) return null;
  // source.timestamp: when that packet's audio was played out, on performance.timeOrigin's clock.
  const sinceMs = performance.timeOrigin + performance.now() - source.timestamp;
  return (source.rtpTimestamp + Math.round((Math.max(0, sinceMs) * AUDIO_RATE) / 1000)) >>> 0;
}

/** A 2D mouth from ARKit weights: a jaw that opens, lips that round, spread, press or tuck. */
export function drawMouth(ctx, w) {
  const { width, height } = ctx.canvas;
  const side = (name) => ((w[`${name}Left`] ?? 0) + (w[`${name}Right`] ?? 0)) / 2;
  const round = Math.max(w.mouthPucker ?? 0, (w.mouthFunnel ?? 0) * 0.8);
  const half = width * 0.22 * (1 + 0.35 * side("mouthStretch") + 0.2 * side("mouthSmile") - 0.45 * round);
  const closed = Math.max(w.mouthClose ?? 0, side("mouthPress"));
  const open = height * 0.36 * (w.jawOpen ?? 0) * (1 - closed);
  const tuck = w.mouthRollLower ?? 0; // FF: the lower lip up under the upper teeth
  const cx = width / 2;
  const cy = height / 2;
  const lip = height * 0.06;
  ctx.clearRect(0, 0, width, height);
  ctx.fillStyle = "#f3d3c3";
  ctx.fillRect(0, 0, width, height);
  // The opening.
  ctx.fillStyle = "#3b0d12";
  ctx.beginPath();
  ctx.moveTo(cx - half, cy);
  ctx.quadraticCurveTo(cx, cy - open * 0.6, cx + half, cy);
  ctx.quadraticCurveTo(cx, cy + open * 1.4 * (1 - 0.7 * tuck), cx - half, cy);
  ctx.fill();
  if (tuck > 0.2) {
    ctx.fillStyle = "#f8f8f0"; // the upper teeth on the lower lip
    ctx.fillRect(cx - half * 0.5, cy - lip * 0.2, half, lip * 0.5 * tuck);
  }
  // The lips.
  ctx.strokeStyle = "#b4505a";
  ctx.lineWidth = lip;
  ctx.lineCap = "round";
  ctx.beginPath();
  ctx.moveTo(cx - half, cy);
  ctx.quadraticCurveTo(cx, cy - open * 0.6 - lip * 0.5, cx + half, cy);
  ctx.stroke();
  ctx.beginPath();
  ctx.moveTo(cx - half, cy);
  ctx.quadraticCurveTo(cx, cy + open * 1.4 * (1 - 0.7 * tuck) + lip * (0.5 - 0.4 * tuck), cx + half, cy);
  ctx.stroke();
}

function main() {
  const $ = (id) => document.getElementById(id);
  const { token } = takeUrlToken();
  const canvas = $("mouth");
  const ctx = canvas.getContext("2d");
  const track = new VisemeTrack();
  const drawn = { frames: 0, visemes: {}, behindMs: [], speakingTicks: 0, speakingMisses: 0 };
  let call = null;
  const rest = Object.fromEntries(BLEND_SHAPES.map((name) => [name, 0]));

  const tick = () => {
    const now = playingRtp(call?.pc);
    const { frame, behind } = now === null ? { frame: null, behind: Infinity } : track.at(now);
    drawMouth(ctx, frame ? frame.weights : rest);
    if (call?.state === "speaking") {
      drawn.speakingTicks += 1;
      if (!frame) drawn.speakingMisses += 1;
    }
    if (frame) {
      drawn.frames += 1;
      drawn.visemes[frame.viseme] = (drawn.visemes[frame.viseme] ?? 0) + 1;
      if (!frame.end) drawn.behindMs.push((behind * 1000) / AUDIO_RATE);
      $("viseme").textContent = frame.viseme;
    }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);

  $("start").addEventListener("click", async () => {
    $("start").disabled = true;
    call = new Call($("remote"), { token, visemes: true });
    call.addEventListener("viseme", (event) => track.add(decodeFrame(event.detail)));
    call.addEventListener("event", (event) => {
      if (event.detail.type === "state") $("status").textContent = event.detail.state;
    });
    if (new URLSearchParams(location.search).has("testHooks")) {
      window.visemeDemo = { call, track, drawn };
    }
    try {
      await call.start();
      $("say").disabled = false;
    } catch (err) {
      $("status").textContent = err.message;
      $("start").disabled = false;
    }
  });
  $("say-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("say-text").value.trim();
    if (text) call?.send({ type: "say", text });
  });
}

if (typeof document !== "undefined" && document.getElementById("mouth")) main();
