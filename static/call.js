// One avatar call, shared by the call page (client.js) and the embeddable page (embed-frame.js):
// one RTCPeerConnection (ICE servers from GET /ice-servers), non-trickle offer/answer over
// POST /offer, an "events" data channel for state and control. Audio and video of the avatar
// play on one <video> element; the browser's own RTP/RTCP lip-sync keeps them together. No UI
// here: a Call dispatches events and the page decides what to show.
//
// Events (CustomEvent, on the Call itself):
//   "event"      detail: a data-channel event from the server ({type: "state", ...}, ...)
//   "viseme"     detail: one binary viseme frame (an ArrayBuffer; visemes.js decodes it), for a
//                Call made with {visemes: true}
//   "connection" detail: the RTCPeerConnection's connectionState
//   "reconnecting" detail: {attempt, delayMs}: the link was lost (ICE failed, or disconnected
//                for 4 s); a new peer connection resumes the call after delayMs
//   "reconnected" detail: {attempt}: the call goes on, its conversation intact
//   "closed"     detail: {reason}: the call is over and cannot come back (not sent for stop())
//   "channel"    detail: true when the data channel opens, false when it closes
//   "microphone" detail: {deviceId, label} of the microphone the call sends (at start and
//                after each switch, the fall-back when one is unplugged included)
//   "devices"    detail: [{deviceId, label}] of the microphones, when one is plugged or unplugged
//
// Test hook fields: pc, sessionId, channel, playing (a Promise), state, states (every state
// event, in order), events (every data-channel event, in order).

const ICE_GATHERING_TIMEOUT_MS = 5000;
/** "disconnected" this long: the link is taken as lost and a new peer connection resumes the call. */
const DISCONNECTED_WAIT_MS = 4000;
/** How long a resumed peer connection may take to connect before the next try. */
const RESUME_CONNECT_MS = 8000;
const BACKOFF_FIRST_MS = 500;
const BACKOFF_MAX_MS = 8000;

/** Exponential backoff with jitter: attempt n waits between half and all of 0.5 s * 2^(n-1), at most 8 s. */
export function backoffMs(attempt) {
  const ceiling = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** (attempt - 1));
  return ceiling / 2 + Math.random() * (ceiling / 2);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Whether `pc` is connected within `ms` (false as soon as it fails). */
function connectedWithin(pc, ms) {
  return new Promise((resolve) => {
    const check = () => {
      const state = pc.connectionState;
      if (state === "connected" || state === "failed" || state === "closed") finish(state === "connected");
    };
    const finish = (result) => {
      clearTimeout(timer);
      pc.removeEventListener("connectionstatechange", check);
      resolve(result);
    };
    const timer = setTimeout(() => finish(false), ms);
    pc.addEventListener("connectionstatechange", check);
    check();
  });
}

/** A readable Error from a failed HTTP response with the API's JSON error shape. */
export async function httpError(response) {
  let error = new Error(`HTTP ${response.status} ${response.statusText}`);
  try {
    const body = await response.json();
    if (body?.error?.message) {
      error = new Error(`${body.error.message} (${body.error.code}, HTTP ${response.status})`);
      error.code = body.error.code;
    }
  } catch {
    // Not JSON: keep the status line.
  }
  error.status = response.status;
  return error;
}

/**
 * The call token a page's URL carries in its fragment (#token=...), or null. A fragment never
 * reaches the server, a proxy or their logs, as a query would. The token is taken out of the
 * address bar, so that a copied or bookmarked link does not carry it. A token in the query is
 * not used: `queryToken` is then true, and the page says where the token goes.
 */
export function takeUrlToken() {
  const queryToken = new URLSearchParams(location.search).has("token");
  const fragment = new URLSearchParams(location.hash.slice(1));
  const token = fragment.get("token");
  if (token !== null) {
    fragment.delete("token");
    const rest = fragment.toString();
    history.replaceState(history.state, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
  }
  return { token: token || null, queryToken };
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

/**
 * What the microphone is asked for, whatever the browser's defaults: its echo canceller (a
 * barge-in must hear the caller, not the avatar's own voice from the speakers), noise
 * suppression, gain control, and one channel (the server listens in mono).
 */
export const MICROPHONE_CONSTRAINTS = Object.freeze({
  echoCancellation: true,
  noiseSuppression: true,
  autoGainControl: true,
  channelCount: 1,
});

/** The microphone (the default one, or `deviceId`), or null with the reason it is missing. */
async function openMicrophone(deviceId = null) {
  if (!navigator.mediaDevices?.getUserMedia) {
    return { stream: null, reason: "this browser offers no microphone access" };
  }
  const audio = { ...MICROPHONE_CONSTRAINTS };
  if (deviceId) audio.deviceId = { exact: deviceId };
  try {
    return { stream: await navigator.mediaDevices.getUserMedia({ audio }), reason: "" };
  } catch (err) {
    const reason = err.name === "NotAllowedError" ? "microphone permission denied" : err.message;
    return { stream: null, reason };
  }
}

/** The microphones the browser offers: [{deviceId, label}] (labels once permission is given). */
export async function listMicrophones() {
  if (!navigator.mediaDevices?.enumerateDevices) return [];
  const devices = await navigator.mediaDevices.enumerateDevices();
  return devices
    .filter((d) => d.kind === "audioinput")
    .map((d, i) => ({ deviceId: d.deviceId, label: d.label || `Microphone ${i + 1}` }));
}

/** The level of a microphone stream, for a meter: RMS of its latest samples, 0 to 1. */
class MicrophoneLevel {
  constructor(stream) {
    this.context = new AudioContext();
    this.analyser = this.context.createAnalyser();
    this.analyser.fftSize = 1024;
    this.samples = new Float32Array(this.analyser.fftSize);
    this.source = null;
    this.follow(stream);
  }

  follow(stream) {
    this.source?.disconnect();
    this.source = this.context.createMediaStreamSource(stream);
    this.source.connect(this.analyser);
  }

  level() {
    this.analyser.getFloatTimeDomainData(this.samples);
    let sum = 0;
    for (const x of this.samples) sum += x * x;
    return Math.sqrt(sum / this.samples.length);
  }

  close() {
    this.source?.disconnect();
    this.context.close();
  }
}

export class Call extends EventTarget {
  /**
   * @param {HTMLVideoElement} video where the avatar plays
   * @param {{token?: string|null, avatar?: string|null}} options token: sent as
   *   "Authorization: Bearer" on /offer and the session's routes (servers with --api-key);
   *   avatar: asked for in the offer; visemes: open the "visemes" data channel, whose binary
   *   frames shape the avatar's mouth (docs/ARCHITECTURE.md, "The viseme stream");
   *   microphone: the deviceId of the microphone to start with (default: the browser's);
   *   baseUrl: the avatar-rtc server, for a page served from elsewhere (its origin must be
   *   one the server allows, --allowed-origin); default: the page's own origin;
   *   iceTransportPolicy: "relay" sends everything through the TURN servers of /ice-servers
   *   (the caller's addresses never reach the server), default "all"
   */
  constructor(
    video,
    { token = null, avatar = null, visemes = false, microphone = null, baseUrl = "", iceTransportPolicy = "all" } = {},
  ) {
    super();
    this.iceTransportPolicy = iceTransportPolicy;
    this.baseUrl = baseUrl ? new URL(baseUrl, location.href).href.replace(/\/+$/, "") : "";
    this.video = video;
    this.auth = token ? { Authorization: `Bearer ${token}` } : {};
    this.avatar = avatar;
    this.visemes = visemes;
    this.pc = null;
    this.channel = null;
    this.sessionId = null;
    this.microphone = null;
    this.microphoneId = microphone;
    this.audioSender = null;
    this.meter = null;
    this.onDeviceChange = () => this.devicesChanged();
    this.onOnline = () => this.online();
    this.iceServers = [];
    this.resumeCredential = null;
    this.reconnecting = false;
    this.disconnectedTimer = 0;
    this.textOnly = false;
    this.noMicReason = "";
    this.state = null;
    this.states = [];
    this.events = [];
    this.remote = new MediaStream();
    this.playing = new Promise((resolve) => {
      video.addEventListener("playing", () => resolve(), { once: true });
    });
    this.closed = false;
  }

  emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** The address of one of the server's routes (`path` from the root). */
  url(path) {
    return `${this.baseUrl}${path}`;
  }

  async start() {
    const mic = await openMicrophone(this.microphoneId);
    this.microphone = mic.stream;
    this.textOnly = mic.stream === null;
    this.noMicReason = mic.reason;
    if (this.closed) {
      this.microphone?.getTracks().forEach((track) => track.stop());
      return;
    }

    const iceServers = await this.fetchIceServers();
    if (this.closed) {
      this.microphone?.getTracks().forEach((track) => track.stop());
      return;
    }
    this.iceServers = iceServers;
    if (this.microphone) {
      this.watchMicrophone(this.microphone.getAudioTracks()[0]);
      navigator.mediaDevices.addEventListener?.("devicechange", this.onDeviceChange);
    }
    window.addEventListener("online", this.onOnline);
    const offer = this.avatar ? { avatar: this.avatar } : {};
    await this.connect("/offer", offer);
  }

  /** One peer connection for the call: offered to `route` with `extra` in the body. */
  async connect(route, extra) {
    const pc = new RTCPeerConnection({ iceServers: this.iceServers, iceTransportPolicy: this.iceTransportPolicy });
    this.pc = pc;
    this.remote = new MediaStream();
    if (this.microphone) {
      const [track] = this.microphone.getAudioTracks();
      const transceiver = pc.addTransceiver(track, { direction: "sendrecv", streams: [this.microphone] });
      this.audioSender = transceiver.sender;
    } else {
      pc.addTransceiver("audio", { direction: "recvonly" });
    }
    pc.addTransceiver("video", { direction: "recvonly" });
    pc.addEventListener("track", (event) => {
      if (pc === this.pc) this.onTrack(event);
    });
    pc.addEventListener("connectionstatechange", () => this.onConnectionState(pc));
    this.openChannel(pc.createDataChannel("events"));
    if (this.visemes) {
      const frames = pc.createDataChannel("visemes");
      frames.binaryType = "arraybuffer";
      frames.addEventListener("message", (event) => {
        if (!this.closed && event.data instanceof ArrayBuffer) this.emit("viseme", event.data);
      });
    }

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc);
    if (this.closed) return;
    const offer = { sdp: pc.localDescription.sdp, type: pc.localDescription.type, ...extra };
    const response = await fetch(this.url(route), {
      method: "POST",
      headers: { "Content-Type": "application/json", ...this.auth },
      body: JSON.stringify(offer),
    });
    if (!response.ok) throw await httpError(response);
    const answer = await response.json();
    this.sessionId = answer.session_id;
    this.resumeCredential = answer.resume ?? null;
    if (this.closed) {
      await this.deleteSession();
      return;
    }
    await pc.setRemoteDescription({ sdp: answer.sdp, type: answer.type });
  }

  onConnectionState(pc) {
    if (pc !== this.pc || this.closed) return;
    const state = pc.connectionState;
    this.emit("connection", state);
    clearTimeout(this.disconnectedTimer);
    if (state === "failed") {
      this.reconnect();
    } else if (state === "disconnected") {
      // Often a moment's loss that ICE rides out; still down after a while, a new peer.
      this.disconnectedTimer = setTimeout(() => {
        if (pc === this.pc && pc.connectionState === "disconnected") this.reconnect();
      }, DISCONNECTED_WAIT_MS);
    }
  }

  /** The network came back (or changed): a link that is not up is replaced now. */
  online() {
    const state = this.pc?.connectionState;
    if (!this.closed && this.sessionId && state !== "connected" && state !== "new") this.reconnect();
  }

  /**
   * The link is lost: a new peer connection resumes the call (POST /sessions/{id}/resume), with
   * exponential backoff and jitter, until it connects or the server says the call is gone.
   * Emits "reconnecting" ({attempt, delayMs}) before each try, then "reconnected", or "closed"
   * ({reason}) when the call cannot come back.
   */
  async reconnect() {
    if (this.reconnecting || this.closed) return;
    if (!this.resumeCredential || !this.sessionId) {
      this.end("the connection failed");
      return;
    }
    this.reconnecting = true;
    const route = `/sessions/${encodeURIComponent(this.sessionId)}/resume`;
    try {
      for (let attempt = 1; !this.closed; attempt++) {
        this.pc?.close();
        const delayMs = backoffMs(attempt);
        this.emit("reconnecting", { attempt, delayMs });
        await sleep(delayMs);
        if (this.closed) return;
        try {
          await this.connect(route, { resume: this.resumeCredential });
          if (await connectedWithin(this.pc, RESUME_CONNECT_MS)) {
            this.emit("reconnected", { attempt });
            return;
          }
        } catch (err) {
          if (err.status === 401 || err.status === 404) {
            this.end(`the call could not be resumed: ${err.message}`);
            return;
          }
          // The server out of reach, or busy: try again.
        }
      }
    } finally {
      this.reconnecting = false;
    }
  }

  /** The call is over from our side of the link: "closed", and everything let go. */
  end(reason) {
    if (this.closed) return;
    this.emit("closed", { reason });
    this.sessionId = null; // the server has ended it, or will: no DELETE
    this.stop();
  }

  /** STUN/TURN servers (with fresh TURN credentials) from GET /ice-servers; none on loopback. */
  async fetchIceServers() {
    const response = await fetch(this.url("/ice-servers"), { headers: this.auth, cache: "no-store" });
    if (!response.ok) throw await httpError(response);
    const body = await response.json();
    return Array.isArray(body.iceServers) ? body.iceServers : [];
  }

  onTrack(event) {
    // Both tracks go into one MediaStream on one element: the browser syncs them itself.
    const stream = event.streams[0] ?? this.remote;
    if (stream === this.remote) this.remote.addTrack(event.track);
    if (this.video.srcObject !== stream) this.video.srcObject = stream;
  }

  openChannel(channel) {
    this.channel = channel;
    // A resumed call has a new channel: the old one's closing says nothing of it.
    channel.addEventListener("open", () => {
      if (channel === this.channel) this.emit("channel", true);
    });
    channel.addEventListener("close", () => {
      if (!this.closed && channel === this.channel) this.emit("channel", false);
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
    if (typeof event !== "object" || event === null || typeof event.type !== "string") return;
    this.events.push(event);
    if (event.type === "state") {
      this.state = event.state;
      this.states.push(event.state);
    }
    this.emit("event", event);
  }

  /** Sends a client message on the data channel; false when it is not open. */
  send(message) {
    if (this.channel?.readyState !== "open") return false;
    this.channel.send(JSON.stringify(message));
    return true;
  }

  /** Mutes or unmutes the microphone without renegotiating (the track sends silence). */
  setMicrophoneEnabled(enabled) {
    this.microphone?.getAudioTracks().forEach((track) => {
      track.enabled = enabled;
    });
  }

  get microphoneEnabled() {
    return this.microphone?.getAudioTracks().some((track) => track.enabled) ?? false;
  }

  /**
   * Moves the call to another microphone (a deviceId from listMicrophones(); null: the
   * browser's default) without renegotiating: the sender's track is replaced, muting kept.
   * Emits "microphone" with {deviceId, label}. Throws for a call that started without one.
   */
  async switchMicrophone(deviceId) {
    if (!this.audioSender) throw new Error("this call has no microphone to switch (text only)");
    const mic = await openMicrophone(deviceId);
    if (!mic.stream) throw new Error(`cannot open that microphone: ${mic.reason}`);
    if (this.closed) {
      mic.stream.getTracks().forEach((track) => track.stop());
      return;
    }
    const enabled = this.microphoneEnabled;
    const [track] = mic.stream.getAudioTracks();
    track.enabled = enabled;
    await this.audioSender.replaceTrack(track);
    const old = this.microphone;
    this.microphone = mic.stream;
    this.microphoneId = deviceId;
    old?.getTracks().forEach((t) => t.stop());
    this.meter?.follow(mic.stream);
    this.watchMicrophone(track);
  }

  /** Tells the page which microphone is in use, and falls back to the default if it goes. */
  watchMicrophone(track) {
    const { deviceId = "" } = track.getSettings();
    this.emit("microphone", { deviceId, label: track.label });
    track.addEventListener("ended", () => {
      if (!this.closed && this.microphone?.getAudioTracks()[0] === track) {
        this.switchMicrophone(null).catch(() => {});
      }
    });
  }

  /** Plugged or unplugged: "devices" with the new list; a microphone gone falls back. */
  async devicesChanged() {
    if (this.closed) return;
    const devices = await listMicrophones();
    this.emit("devices", devices);
    const track = this.microphone?.getAudioTracks()[0];
    const { deviceId } = track?.getSettings() ?? {};
    const gone = track?.readyState === "ended" || (deviceId && !devices.some((d) => d.deviceId === deviceId));
    if (gone) await this.switchMicrophone(null).catch(() => {});
  }

  /** The microphone's level now (0 to 1), for a meter; 0 without a microphone. */
  microphoneLevel() {
    if (!this.microphone || this.closed) return 0;
    if (!this.meter) this.meter = new MicrophoneLevel(this.microphone);
    return this.meter.level();
  }

  async deleteSession() {
    if (!this.sessionId) return;
    const id = this.sessionId;
    this.sessionId = null;
    try {
      await fetch(this.url(`/sessions/${encodeURIComponent(id)}`), {
        method: "DELETE",
        headers: this.auth,
        keepalive: true,
      });
    } catch {
      // The server may be gone already; the call is over either way.
    }
  }

  async stop() {
    this.closed = true;
    clearTimeout(this.disconnectedTimer);
    window.removeEventListener("online", this.onOnline);
    navigator.mediaDevices?.removeEventListener?.("devicechange", this.onDeviceChange);
    this.meter?.close();
    this.meter = null;
    this.channel?.close();
    this.pc?.close();
    this.microphone?.getTracks().forEach((track) => track.stop());
    this.video.srcObject = null;
    await this.deleteSession();
  }
}

/** getStats figures for an overlay, computed against the previous sample. */
export class StatsSampler {
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
