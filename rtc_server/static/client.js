// The avatar-rtc call page: one RTCPeerConnection, non-trickle offer/answer over POST /offer,
// an "events" data channel for state and control. Audio and video of the avatar play on one
// <video> element; the browser's own RTP/RTCP lip-sync keeps them together.
//
// Test hook: window.avatarCall is the current Call (pc, sessionId, channel, playing, states,
// events: every data-channel event received, in order).

const STATS_INTERVAL_MS = 1000;
// A server started with --api-key wants a call token (POST /token): pass it as ?token=...
const TOKEN = new URLSearchParams(location.search).get("token");
const AUTH = TOKEN ? { Authorization: `Bearer ${TOKEN}` } : {};
const ICE_GATHERING_TIMEOUT_MS = 5000;

const $ = (id) => document.getElementById(id);

const ui = {
  video: $("remote"),
  status: $("status"),
  stats: $("stats"),
  start: $("start"),
  stop: $("stop"),
  interrupt: $("interrupt"),
  sayForm: $("say-form"),
  sayText: $("say-text"),
  send: $("send"),
  ask: $("ask"),
  log: $("log"),
};

const MAX_LOG_LINES = 50;

/** Adds a line to the conversation log, or extends the avatar's current one. */
function logLine(who, text, { extend = false } = {}) {
  const last = ui.log.lastElementChild;
  if (extend && last?.dataset.who === who) {
    last.querySelector("span").textContent += ` ${text}`;
    return;
  }
  const item = document.createElement("li");
  item.dataset.who = who;
  const name = document.createElement("strong");
  name.textContent = who === "user" ? "You" : "Avatar";
  const body = document.createElement("span");
  body.textContent = text;
  item.append(name, " ", body);
  ui.log.append(item);
  while (ui.log.childElementCount > MAX_LOG_LINES) ui.log.firstElementChild.remove();
}

function setStatus(text, kind = "info") {
  ui.status.textContent = text;
  ui.status.dataset.kind = kind;
}

function setInCall(inCall) {
  ui.start.disabled = inCall;
  ui.stop.disabled = !inCall;
}

function setChannelOpen(open) {
  ui.interrupt.disabled = !open;
  ui.sayText.disabled = !open;
  ui.send.disabled = !open;
  ui.ask.disabled = !open;
}

/** A readable message from a failed HTTP response with the API's JSON error shape. */
async function httpError(response) {
  try {
    const body = await response.json();
    if (body?.error?.message) {
      return new Error(`${body.error.message} (${body.error.code}, HTTP ${response.status})`);
    }
  } catch {
    // Not JSON: fall through to the status line.
  }
  return new Error(`HTTP ${response.status} ${response.statusText}`);
}

/** Non-trickle signalling: wait for every candidate (or the timeout, then send what we have). */
function iceGatheringComplete(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => {
      if (pc.iceGatheringState === "complete") done();
    };
    const timer = setTimeout(done, ICE_GATHERING_TIMEOUT_MS);
    pc.addEventListener("icegatheringstatechange", check);
  });
}

/** The microphone, or null (with the reason) when it is denied or missing. */
async function openMicrophone() {
  if (!navigator.mediaDevices?.getUserMedia) {
    return { stream: null, reason: "this browser offers no microphone access" };
  }
  try {
    return { stream: await navigator.mediaDevices.getUserMedia({ audio: true }), reason: "" };
  } catch (err) {
    const reason = err.name === "NotAllowedError" ? "microphone permission denied" : err.message;
    return { stream: null, reason };
  }
}

class Call {
  constructor(video) {
    this.video = video;
    this.pc = null;
    this.channel = null;
    this.sessionId = null;
    this.microphone = null;
    this.textOnly = false;
    this.noMicReason = "";
    this.state = null;
    /** Every state event, in order, e.g. ["listening", "speaking", "listening"]. */
    this.states = [];
    this.events = [];
    this.replying = false;
    this.remote = new MediaStream();
    this.playing = new Promise((resolve) => {
      video.addEventListener("playing", () => resolve(), { once: true });
    });
    this.closed = false;
  }

  async start() {
    setStatus("Connecting…");
    const mic = await openMicrophone();
    this.microphone = mic.stream;
    this.textOnly = mic.stream === null;
    this.noMicReason = mic.reason;

    const pc = new RTCPeerConnection({ iceServers: [] });
    this.pc = pc;
    if (this.microphone) {
      const [track] = this.microphone.getAudioTracks();
      pc.addTransceiver(track, { direction: "sendrecv", streams: [this.microphone] });
    } else {
      pc.addTransceiver("audio", { direction: "recvonly" });
    }
    pc.addTransceiver("video", { direction: "recvonly" });
    pc.addEventListener("track", (event) => this.onTrack(event));
    pc.addEventListener("connectionstatechange", () => this.onConnectionState());
    this.openChannel(pc.createDataChannel("events"));

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);
    if (this.closed) return;
    const response = await fetch("/offer", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...AUTH },
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: pc.localDescription.type }),
    });
    if (!response.ok) throw await httpError(response);
    const answer = await response.json();
    this.sessionId = answer.session_id;
    if (this.closed) {
      await this.deleteSession();
      return;
    }
    await pc.setRemoteDescription({ sdp: answer.sdp, type: answer.type });
  }

  onTrack(event) {
    // Both tracks go into one MediaStream on one element: the browser syncs them itself.
    const stream = event.streams[0] ?? this.remote;
    if (stream === this.remote) this.remote.addTrack(event.track);
    if (this.video.srcObject !== stream) this.video.srcObject = stream;
  }

  onConnectionState() {
    if (this.closed) return;
    const state = this.pc.connectionState;
    if (state === "connected") {
      // The first state event may already have said "Listening"; keep it.
      if (this.state === null) setStatus(`Connected${this.modeNote()}`, "ok");
    } else if (state === "failed") {
      setStatus("Connection failed", "error");
    } else if (state === "disconnected") {
      setStatus("Connection interrupted, waiting…", "warn");
    }
  }

  modeNote() {
    return this.textOnly ? ` (text only: ${this.noMicReason})` : "";
  }

  openChannel(channel) {
    this.channel = channel;
    channel.addEventListener("open", () => setChannelOpen(true));
    channel.addEventListener("close", () => {
      if (!this.closed) setChannelOpen(false);
    });
    channel.addEventListener("message", (event) => this.onMessage(event.data));
  }

  onMessage(data) {
    if (this.closed) return;
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      return;
    }
    this.events.push(event);
    if (event.type === "transcript" && event.final) {
      logLine("user", event.text);
      this.replying = false;
    } else if (event.type === "response") {
      logLine("avatar", event.text, { extend: this.replying });
      this.replying = true;
    } else if (event.type === "turn") {
      this.replying = false;
    }
    if (event.type === "state") {
      this.state = event.state;
      this.states.push(event.state);
      const label = `${event.state[0].toUpperCase()}${event.state.slice(1)}`;
      setStatus(`${label}${this.modeNote()}`, event.state);
    } else if (event.type === "error") {
      setStatus(`Error: ${event.message} (${event.code})`, "error");
    }
  }

  send(message) {
    if (this.channel?.readyState !== "open") return false;
    this.channel.send(JSON.stringify(message));
    return true;
  }

  async deleteSession() {
    if (!this.sessionId) return;
    const id = this.sessionId;
    this.sessionId = null;
    try {
      await fetch(`/sessions/${encodeURIComponent(id)}`, {
        method: "DELETE",
        headers: AUTH,
        keepalive: true,
      });
    } catch {
      // The server may be gone already; the call is over either way.
    }
  }

  async stop() {
    this.closed = true;
    this.channel?.close();
    this.pc?.close();
    this.microphone?.getTracks().forEach((track) => track.stop());
    this.video.srcObject = null;
    await this.deleteSession();
  }
}

/** getStats figures for the overlay, computed against the previous sample. */
class StatsSampler {
  constructor() {
    this.last = null;
  }

  async sample(pc) {
    const report = await pc.getStats();
    let video = null;
    let pair = null;
    let selectedPairId = null;
    report.forEach((s) => {
      if (s.type === "inbound-rtp" && s.kind === "video") video = s;
      if (s.type === "transport" && s.selectedCandidatePairId) selectedPairId = s.selectedCandidatePairId;
    });
    report.forEach((s) => {
      const selected = selectedPairId ? s.id === selectedPairId : s.nominated && s.state === "succeeded";
      if (s.type === "candidate-pair" && selected) pair = s;
    });
    const out = { fps: null, codec: null, kbps: null, rttMs: null };
    if (video) {
      out.fps = video.framesPerSecond ?? null;
      out.codec = report.get(video.codecId)?.mimeType ?? null;
      if (this.last && video.bytesReceived >= this.last.bytes) {
        const seconds = (video.timestamp - this.last.timestamp) / 1000;
        if (seconds > 0) out.kbps = ((video.bytesReceived - this.last.bytes) * 8) / 1000 / seconds;
      }
      this.last = { bytes: video.bytesReceived, timestamp: video.timestamp };
    }
    if (pair?.currentRoundTripTime !== undefined) out.rttMs = pair.currentRoundTripTime * 1000;
    return out;
  }
}

function showStats({ fps, codec, kbps, rttMs }) {
  const fields = {
    fps: fps === null ? "–" : fps.toFixed(0),
    codec: codec ?? "–",
    kbps: kbps === null ? "–" : `${kbps.toFixed(0)} kbps`,
    rtt: rttMs === null ? "–" : `${rttMs.toFixed(0)} ms`,
  };
  for (const [name, text] of Object.entries(fields)) {
    ui.stats.querySelector(`[data-stat="${name}"]`).textContent = text;
  }
}

let call = null;
let statsTimer = 0;

function startStats(pc) {
  const sampler = new StatsSampler();
  ui.stats.hidden = false;
  statsTimer = setInterval(async () => {
    if (pc.connectionState === "closed") return;
    try {
      showStats(await sampler.sample(pc));
    } catch {
      // getStats can fail while the pc closes; the next tick or stop() settles it.
    }
  }, STATS_INTERVAL_MS);
}

function stopStats() {
  clearInterval(statsTimer);
  ui.stats.hidden = true;
}

async function startCall() {
  setInCall(true);
  call = new Call(ui.video);
  window.avatarCall = call;
  try {
    await call.start();
    startStats(call.pc);
  } catch (err) {
    setStatus(`Could not connect: ${err.message}`, "error");
    await stopCall({ keepStatus: true });
  }
}

async function stopCall({ keepStatus = false } = {}) {
  stopStats();
  setChannelOpen(false);
  const ending = call;
  call = null;
  if (ending) await ending.stop();
  setInCall(false);
  if (!keepStatus) setStatus("Call ended. Press Start to call again.");
}

ui.start.addEventListener("click", startCall);
ui.stop.addEventListener("click", () => stopCall());
ui.interrupt.addEventListener("click", () => call?.send({ type: "interrupt" }));
ui.sayForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.sayText.value.trim();
  if (text && call?.send({ type: "say", text })) ui.sayText.value = "";
});
ui.ask.addEventListener("click", () => {
  const text = ui.sayText.value.trim();
  if (!text || !call?.send({ type: "text", text })) return;
  logLine("user", text);
  call.replying = false;
  ui.sayText.value = "";
});
window.addEventListener("pagehide", () => call?.stop());
