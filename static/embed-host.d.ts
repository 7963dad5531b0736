// TypeScript declarations of embed-host.js (and of embed.js's window.AvatarRTC): the avatar in
// an <iframe>, driven over postMessage (docs/DECISIONS.md, "Embedding").

export interface EmbedOptions {
  /** The avatar-rtc server (required from the module; embed.js defaults to where it came from). */
  server?: string;
  /** A call token, sent in the start command, never in a URL. */
  token?: string | null;
  autostart?: boolean;
  avatar?: string;
  theme?: "dark" | "light";
  /** The frame's title, for assistive technology. */
  title?: string;
}

/** A message from the frame: ready, connected, reconnecting, reconnected, closed, microphone,
 * state, transcript, response, turn, error. */
export interface EmbedEvent {
  type: string;
  [field: string]: unknown;
}

export class AvatarEmbed {
  constructor(container: Element, options?: EmbedOptions);
  readonly frame: HTMLIFrameElement | null;
  readonly origin: string;
  ready: boolean;
  start(token?: string): this;
  stop(): this;
  /** The avatar speaks these words. */
  say(text: string): this;
  /** A typed user turn: the avatar answers it as if it had been spoken. */
  text(text: string): this;
  interrupt(): this;
  /** `type` is an event's type, or "*" for every one. */
  on(type: string, listener: (event: EmbedEvent) => void): this;
  off(type: string, listener: (event: EmbedEvent) => void): this;
  /** Ends the call and removes the frame. */
  destroy(): void;
}

export function embed(container: Element, options?: EmbedOptions): AvatarEmbed;
export const version: number;

declare global {
  interface Window {
    AvatarRTC: { version: number; Avatar: typeof AvatarEmbed; embed: typeof embed };
  }
}
