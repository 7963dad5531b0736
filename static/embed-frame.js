// The embeddable avatar page (GET /embed): one Call (call.js), driven by the host page over
// postMessage or by its own Start button.
//
// Protocol (docs/DECISIONS.md, "Embedding"): every message is an object with avatarRtc: 1 and a
// string type. Commands from the parent: hello, start {token?}, stop, say {text}, text {text},
// interrupt. Events to the parent: ready, connected {sessionId}, closed {reason},
// microphone {enabled}, and every data-channel event as it is (state, transcript, response,
// turn, error); error {code, message} also for failures of the page itself.
//
// Commands are taken only from window.parent and only when its origin is allowed (the server's
// own or an --allowed-origin, rendered into <html data-allowed-origins>); events go only to that
// origin, never to "*".
//
// Test hook, for the browser tests only: with ?testHooks in the frame's URL (embed.js passes
// it on from the host page's), window.avatarCall is the current Call; otherwise nothing is
// exposed.

import { Call, takeUrlToken } from "./call.js";

const PROTOCOL = 1;
const MAX_PENDING = 20;

const root = document.documentElement;
const settings = {
  autostart: root.dataset.autostart === "true",
  avatar: root.dataset.avatar || null,
  allowedOrigins: parseOrigins(root.dataset.allowedOrigins),
};
// A server started with --api-key wants a call token: from the start command, or #token=...
const { token: URL_TOKEN, queryToken: QUERY_TOKEN } = takeUrlToken();

const $ = (id) => document.getElementById(id);
const ui = { video: $("remote"), start: $("start"), mic: $("mic"), status: $("status") };

function parseOrigins(text) {
  try {
    const origins = JSON.parse(text ?? "[]");
    return Array.isArray(origins) ? origins.filter((o) => typeof o === "string") : [];
  } catch {
    return [];
  }
}

function originAllowed(origin) {
  if (origin === location.origin) return true;
  return settings.allowedOrigins.includes("*") || settings.allowedOrigins.includes(origin);
}

// ---------------------------------------------------------------------------------------------
// The parent page

const TEST_HOOKS = new URLSearchParams(location.search).has("testHooks");
const framed = window.parent !== window;

/** The parent's origin as the browser reports it, before it has sent anything. */
function claimedParentOrigin() {
  if (location.ancestorOrigins) return location.ancestorOrigins[0] ?? null;
  try {
    return document.referrer ? new URL(document.referrer).origin : null;
  } catch {
    return null;
  }
}

/** Where events go; null until known and allowed (then a first command from the parent sets it). */
let parentOrigin = null;
if (framed) {
  const claimed = claimedParentOrigin();
  if (claimed && originAllowed(claimed)) parentOrigin = claimed;
}

function post(message) {
  if (!framed || parentOrigin === null) return;
  window.parent.postMessage({ ...message, avatarRtc: PROTOCOL }, parentOrigin);
}

function postError(code, message, extra = {}) {
  post({ type: "error", code, message, ...extra });
}

// ---------------------------------------------------------------------------------------------
// The call

let call = null;
/** say/text/interrupt sent while the call connects; they go out once the channel opens. */
let pending = [];

function setStatus(text, kind = "info") {
  ui.status.textContent = text;
  ui.status.dataset.kind = kind;
}

function showMicrophone(current) {
  ui.mic.hidden = current === null || current.textOnly;
  const muted = current !== null && !current.microphoneEnabled;
  ui.mic.setAttribute("aria-pressed", String(muted));
  const label = muted ? "Unmute microphone" : "Mute microphone";
  ui.mic.setAttribute("aria-label", label);
  ui.mic.title = label;
}

function onChannel(current, open) {
  if (current !== call) return;
  if (!open) {
    endCall("ended");
    return;
  }
  setStatus("");
  showMicrophone(current);
  post({ type: "connected", sessionId: current.sessionId, textOnly: current.textOnly });
  for (const message of pending) current.send(message);
  pending = [];
}

/** Plays the avatar; where the browser blocks sound without a gesture, muted with an Unmute button. */
async function play() {
  try {
    await ui.video.play();
  } catch (err) {
    if (err.name !== "NotAllowedError") return;
    ui.video.muted = true;
    ui.start.textContent = "Unmute";
    ui.start.hidden = false;
    await ui.video.play().catch(() => {});
  }
}

async function startCall(token) {
  if (call) return;
  if (QUERY_TOKEN && !token && !URL_TOKEN) {
    const message = "the call token goes in the frame URL's fragment (#token=...), not its query";
    setStatus(`Could not connect: ${message}`, "error");
    postError("token_in_query", message);
    return;
  }
  ui.start.hidden = true;
  setStatus("Connecting…");
  const current = new Call(ui.video, { token: token || URL_TOKEN, avatar: settings.avatar });
  call = current;
  if (TEST_HOOKS) window.avatarCall = current;
  current.addEventListener("channel", (e) => onChannel(current, e.detail));
  // A lost link is resumed by the Call itself; the host page hears of it.
  current.addEventListener("reconnecting", (e) => {
    if (current !== call) return;
    setStatus("Reconnecting…", "warn");
    post({ type: "reconnecting", attempt: e.detail.attempt });
  });
  current.addEventListener("reconnected", () => {
    if (current !== call) return;
    setStatus("");
    post({ type: "reconnected" });
  });
  current.addEventListener("closed", (e) => {
    if (current === call) endCall(e.detail.reason);
  });
  current.addEventListener("event", (e) => post(e.detail));
  try {
    await current.start();
    if (current === call) await play();
  } catch (err) {
    if (current !== call) return;
    setStatus(`Could not connect: ${err.message}`, "error");
    postError(err.code ?? "connect_failed", err.message, err.status ? { status: err.status } : {});
    await endCall("connect_failed", { keepStatus: true });
  }
}

async function endCall(reason, { keepStatus = false } = {}) {
  const ending = call;
  if (!ending) return;
  call = null;
  pending = [];
  showMicrophone(null);
  await ending.stop();
  ui.video.muted = false;
  ui.start.textContent = "Start";
  ui.start.hidden = false;
  if (!keepStatus) setStatus("");
  post({ type: "closed", reason });
}

/** say, text or interrupt: on the data channel, or queued while the call connects. */
function relay(message) {
  if (call?.send(message)) return;
  if (call && pending.length < MAX_PENDING) {
    pending.push(message);
  } else {
    postError("not_connected", `no call to send '${message.type}' to: send 'start' first`);
  }
}

function onCommand(command) {
  switch (command.type) {
    case "hello":
      post({ type: "ready", autostart: settings.autostart });
      break;
    case "start":
      startCall(typeof command.token === "string" ? command.token : null);
      break;
    case "stop":
      endCall("stopped");
      break;
    case "say":
    case "text":
      if (typeof command.text !== "string" || !command.text.trim()) {
        postError("bad_command", `'${command.type}' needs a non-empty 'text'`);
      } else {
        relay({ type: command.type, text: command.text });
      }
      break;
    case "interrupt":
      relay({ type: "interrupt" });
      break;
    default:
      postError("bad_command", `unknown command ${JSON.stringify(command.type)}`);
  }
}

window.addEventListener("message", (event) => {
  if (!framed || event.source !== window.parent || !originAllowed(event.origin)) return;
  if (parentOrigin === null) parentOrigin = event.origin;
  if (event.origin !== parentOrigin) return;
  const command = event.data;
  if (typeof command !== "object" || command === null || command.avatarRtc !== PROTOCOL) return;
  if (typeof command.type !== "string") return;
  onCommand(command);
});

ui.start.addEventListener("click", () => {
  if (call && ui.video.muted) {
    ui.video.muted = false;
    ui.start.hidden = true;
    ui.start.textContent = "Start";
  } else {
    startCall(null);
  }
});

ui.mic.addEventListener("click", () => {
  if (!call) return;
  call.setMicrophoneEnabled(!call.microphoneEnabled);
  showMicrophone(call);
  post({ type: "microphone", enabled: call.microphoneEnabled });
});

window.addEventListener("pagehide", () => call?.stop());

post({ type: "ready", autostart: settings.autostart });
if (settings.autostart) startCall(null);
else ui.start.hidden = false;
