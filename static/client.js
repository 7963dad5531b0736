// The avatar-rtc call page: the UI around one Call (call.js has the call itself).
//
// Test hook, for the browser tests and benchmarks only: with ?testHooks in the page's URL,
// window.avatarCall is the current Call (pc, sessionId, channel, playing, states, events:
// every data-channel event received, in order). Without it the page exposes nothing.

import { Call, StatsSampler, listMicrophones, takeUrlToken } from "./call.js";

const STATS_INTERVAL_MS = 1000;
const METER_INTERVAL_MS = 100;
/** Speech at a normal distance has an RMS of about 0.05 to 0.2: shown at a quarter to full. */
const METER_GAIN = 4;
// A server started with --api-key wants a call token (POST /token): pass it as #token=...
const { token: TOKEN, queryToken: QUERY_TOKEN } = takeUrlToken();
const QUERY_TOKEN_NOTE = "The call token goes in the link's fragment (#token=...), not its query (?token=...).";
const TEST_HOOKS = new URLSearchParams(location.search).has("testHooks");
// ?relay: the call goes through the TURN servers only (checks a TURN deployment end to end).
const RELAY_ONLY = new URLSearchParams(location.search).has("relay");

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
  microphone: $("microphone"),
  mute: $("mute"),
  mic: $("mic"),
  micLevel: $("mic-level"),
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

/** The microphone picker lists `devices`, `current` chosen. */
function showMicrophones(devices, current) {
  ui.mic.replaceChildren(
    ...devices.map(({ deviceId, label }) => {
      const option = document.createElement("option");
      option.value = deviceId;
      option.textContent = label;
      return option;
    }),
  );
  if (current !== undefined) ui.mic.value = current;
}

let meterTimer = 0;

async function startMicrophoneControls(c) {
  if (c.textOnly) return;
  ui.microphone.hidden = false;
  ui.mute.setAttribute("aria-pressed", "false");
  showMicrophones(await listMicrophones(), c.microphone?.getAudioTracks()[0]?.getSettings().deviceId);
  meterTimer = setInterval(() => {
    ui.micLevel.value = Math.min(1, c.microphoneLevel() * METER_GAIN);
  }, METER_INTERVAL_MS);
}

function stopMicrophoneControls() {
  clearInterval(meterTimer);
  ui.microphone.hidden = true;
  ui.micLevel.value = 0;
}

let call = null;
/** Whether the avatar's current reply already has a line in the log (response parts extend it). */
let replying = false;
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

function modeNote(c) {
  return c.textOnly ? ` (text only: ${c.noMicReason})` : "";
}

function onConnection(c, state) {
  if (state === "connected") {
    // The first state event may already have said "Listening"; keep it.
    if (c.state === null) setStatus(`Connected${modeNote(c)}`, "ok");
  } else if (state === "disconnected") {
    setStatus("Connection interrupted, waiting…", "warn");
  }
}

function onEvent(c, event) {
  if (event.type === "transcript" && event.final) {
    logLine("user", event.text);
    replying = false;
  } else if (event.type === "response") {
    logLine("avatar", event.text, { extend: replying });
    replying = true;
  } else if (event.type === "turn") {
    replying = false;
  } else if (event.type === "state") {
    const label = `${event.state[0].toUpperCase()}${event.state.slice(1)}`;
    setStatus(`${label}${modeNote(c)}`, event.state);
  } else if (event.type === "error") {
    setStatus(`Error: ${event.message} (${event.code})`, "error");
  }
}

async function startCall() {
  if (QUERY_TOKEN && !TOKEN) {
    setStatus(QUERY_TOKEN_NOTE, "error");
    return;
  }
  setInCall(true);
  setStatus("Connecting…");
  const current = new Call(ui.video, { token: TOKEN, iceTransportPolicy: RELAY_ONLY ? "relay" : "all" });
  call = current;
  replying = false;
  if (TEST_HOOKS) window.avatarCall = current;
  current.addEventListener("connection", (e) => onConnection(current, e.detail));
  current.addEventListener("channel", (e) => setChannelOpen(e.detail));
  current.addEventListener("event", (e) => onEvent(current, e.detail));
  current.addEventListener("reconnecting", (e) => {
    setStatus(`Connection lost, reconnecting (try ${e.detail.attempt})…`, "warn");
  });
  current.addEventListener("reconnected", () => {
    setStatus("Reconnected", "ok");
    stopStats();
    startStats(current.pc);
  });
  current.addEventListener("closed", (e) => {
    if (call !== current) return;
    setStatus(`Call ended: ${e.detail.reason}`, "error");
    stopCall({ keepStatus: true });
  });
  current.addEventListener("devices", (e) => showMicrophones(e.detail, ui.mic.value));
  current.addEventListener("microphone", (e) => {
    if ([...ui.mic.options].some((o) => o.value === e.detail.deviceId)) ui.mic.value = e.detail.deviceId;
  });
  try {
    await current.start();
    startStats(current.pc);
    await startMicrophoneControls(current);
  } catch (err) {
    setStatus(`Could not connect: ${err.message}`, "error");
    await stopCall({ keepStatus: true });
  }
}

async function stopCall({ keepStatus = false } = {}) {
  stopStats();
  stopMicrophoneControls();
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
ui.mute.addEventListener("click", () => {
  if (!call) return;
  const muted = ui.mute.getAttribute("aria-pressed") !== "true";
  call.setMicrophoneEnabled(!muted);
  ui.mute.setAttribute("aria-pressed", String(muted));
});
ui.mic.addEventListener("change", async () => {
  const current = call;
  try {
    await current?.switchMicrophone(ui.mic.value);
  } catch (err) {
    setStatus(`Microphone: ${err.message}`, "error");
  }
});
ui.sayForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.sayText.value.trim();
  if (text && call?.send({ type: "say", text })) ui.sayText.value = "";
});
ui.ask.addEventListener("click", () => {
  const text = ui.sayText.value.trim();
  if (!text || !call?.send({ type: "text", text })) return;
  logLine("user", text);
  replying = false;
  ui.sayText.value = "";
});
window.addEventListener("pagehide", () => call?.stop());
