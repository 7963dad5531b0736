// TypeScript declarations of call.js: one avatar call from a browser (docs/ARCHITECTURE.md has
// the server's side of the contract: the HTTP routes, the events channel, the viseme stream).

/** A server event from the "events" data channel: state, transcript, response, turn, error... */
export interface ServerEvent {
  type: string;
  [field: string]: unknown;
}

export interface CallOptions {
  /** A call token (POST /token) for servers with --api-key; sent as "Authorization: Bearer". */
  token?: string | null;
  /** Asked for in the offer (a server serves one avatar: leave it out). */
  avatar?: string | null;
  /** Open the binary "visemes" data channel ("viseme" events on the Call). */
  visemes?: boolean;
  /** The deviceId of the microphone to start with (default: the browser's). */
  microphone?: string | null;
  /** The avatar-rtc server, for a page served from elsewhere (its origin must be allowed by
   * the server's --allowed-origin); default: the page's own origin. */
  baseUrl?: string;
  /** "relay": everything through the TURN servers of /ice-servers (the caller's addresses never
   * reach the server); default "all". */
  iceTransportPolicy?: RTCIceTransportPolicy;
}

export interface Microphone {
  deviceId: string;
  label: string;
}

export interface CallEventMap {
  /** A data-channel event from the server. */
  event: CustomEvent<ServerEvent>;
  /** One binary viseme frame (visemes.js decodes it), for a Call made with {visemes: true}. */
  viseme: CustomEvent<ArrayBuffer>;
  /** The RTCPeerConnection's connectionState. */
  connection: CustomEvent<RTCPeerConnectionState>;
  /** True when the data channel opens, false when it closes. */
  channel: CustomEvent<boolean>;
  /** The microphone the call sends (at start, after each switch and fall-back). */
  microphone: CustomEvent<Microphone>;
  /** The microphones, when one is plugged or unplugged. */
  devices: CustomEvent<Microphone[]>;
  /** The link was lost; a new peer connection resumes the call after delayMs. */
  reconnecting: CustomEvent<{ attempt: number; delayMs: number }>;
  /** The call goes on over a new peer connection, its conversation intact. */
  reconnected: CustomEvent<{ attempt: number }>;
  /** The call is over and cannot come back (not sent for stop()). */
  closed: CustomEvent<{ reason: string }>;
}

export class Call extends EventTarget {
  constructor(video: HTMLVideoElement, options?: CallOptions);
  readonly video: HTMLVideoElement;
  /** The current peer connection (a new one after each reconnection). */
  pc: RTCPeerConnection | null;
  /** The "events" data channel of the current peer connection. */
  channel: RTCDataChannel | null;
  sessionId: string | null;
  /** The microphone stream, or null for a text-only call. */
  microphone: MediaStream | null;
  textOnly: boolean;
  /** Why the call is text only ("" when it is not). */
  noMicReason: string;
  /** The last state event's state (listening, thinking, speaking). */
  state: string | null;
  states: string[];
  /** Every data-channel event received, in order. */
  events: ServerEvent[];
  /** Resolves when the avatar first plays. */
  playing: Promise<void>;
  closed: boolean;

  /** Opens the microphone (or goes text only), fetches the ICE servers and connects. */
  start(): Promise<void>;
  /** Hangs up: DELETE /sessions/{id}, the peer connection and the microphone closed. */
  stop(): Promise<void>;
  /** Sends a client message on the data channel ({type: "say" | "text" | "interrupt", ...});
   * false when it is not open. */
  send(message: { type: string; [field: string]: unknown }): boolean;
  /** Mutes or unmutes the microphone without renegotiating (the track sends silence). */
  setMicrophoneEnabled(enabled: boolean): void;
  readonly microphoneEnabled: boolean;
  /** Moves the call to another microphone (null: the default) without renegotiating. */
  switchMicrophone(deviceId: string | null): Promise<void>;
  /** The microphone's level now, 0 to 1 (RMS), for a meter. */
  microphoneLevel(): number;
  /** Resumes the call on a new peer connection now (it does so by itself when ICE fails). */
  reconnect(): Promise<void>;

  addEventListener<K extends keyof CallEventMap>(
    type: K,
    listener: (event: CallEventMap[K]) => void,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(
    type: string,
    listener: EventListenerOrEventListenerObject,
    options?: boolean | AddEventListenerOptions,
  ): void;
  removeEventListener<K extends keyof CallEventMap>(
    type: K,
    listener: (event: CallEventMap[K]) => void,
    options?: boolean | EventListenerOptions,
  ): void;
  removeEventListener(
    type: string,
    listener: EventListenerOrEventListenerObject,
    options?: boolean | EventListenerOptions,
  ): void;
}

/** What the microphone is asked for: echo cancellation, noise suppression, gain control, mono. */
export const MICROPHONE_CONSTRAINTS: Readonly<{
  echoCancellation: true;
  noiseSuppression: true;
  autoGainControl: true;
  channelCount: 1;
}>;

/** The microphones the browser offers (labels once permission is given). */
export function listMicrophones(): Promise<Microphone[]>;

/** The wait before reconnection attempt n (1, 2, ...): half to all of 0.5 s * 2^(n-1), at most 8 s. */
export function backoffMs(attempt: number): number;

/** A readable Error from a failed HTTP response with the API's JSON error shape. */
export function httpError(response: Response): Promise<Error & { status: number; code?: string }>;

/** The call token of the page's URL fragment (#token=...), taken out of the address bar. */
export function takeUrlToken(): { token: string | null; queryToken: boolean };

/** getStats figures for an overlay, against the previous sample. */
export class StatsSampler {
  sample(pc: RTCPeerConnection): Promise<{
    fps: number | null;
    codec: string | null;
    kbps: number | null;
    rttMs: number | null;
  }>;
}
