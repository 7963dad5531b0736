// avatar-rtc embed: put the talking avatar on your page.
//
//   <script src="https://avatar.example.com/static/embed.js"></script>
//   <div id="avatar" style="width: 360px; height: 360px"></div>
//   <script>
//     const avatar = AvatarRTC.embed(document.getElementById("avatar"), { autostart: true });
//     avatar.on("response", (e) => console.log("avatar:", e.text));
//     avatar.say("Hello!");
//   </script>
//
// Options: server (default: where this script came from), token (servers with --api-key; sent in
// the start command, never in the URL), autostart, avatar, theme ("dark" | "light"), title.
// Methods: start(token?), stop(), say(text), text(text), interrupt(), on(type, fn), off(type,
// fn), destroy(). Events: ready, connected, reconnecting, reconnected, closed, microphone, state,
// transcript, response, turn, error; "*" gets every one. The page's origin must be allowed by the server
// (--allowed-origin), or the browser refuses the frame and an error event says so.
//
// As an ES module: embed-host.js (the same code; give it the 'server' option).
//
// Messages go only to the server's origin, and only those from this avatar's own frame and that
// origin are taken (docs/DECISIONS.md, "Embedding").
(function () {
  "use strict";

  const PROTOCOL = 1;
  /** After the frame's load event, how long to wait for "ready" before reporting it blocked. */
  const READY_GRACE_MS = 2000;
  const SCRIPT_SRC = document.currentScript ? document.currentScript.src : null;

  class Avatar {
    constructor(container, options = {}) {
      if (!(container instanceof Element)) throw new TypeError("AvatarRTC.embed needs an element");
      const base = options.server || SCRIPT_SRC;
      if (!base) throw new TypeError("AvatarRTC.embed needs the 'server' option");
      const server = new URL(base, location.href);
      this.origin = server.origin;
      this.token = options.token || null;
      this.ready = false;
      this.listeners = new Map();
      this.queue = [];

      const url = new URL("/embed", server);
      // With a token, the call starts with the start command that carries it.
      if (options.autostart && !this.token) url.searchParams.set("autostart", "1");
      if (options.avatar) url.searchParams.set("avatar", options.avatar);
      if (options.theme) url.searchParams.set("theme", options.theme);
      // The browser tests' hook (window.avatarCall in the frame), passed on from the host page.
      if (new URLSearchParams(location.search).has("testHooks")) {
        url.searchParams.set("testHooks", "1");
      }
      if (options.autostart && this.token) this.start();

      const frame = document.createElement("iframe");
      frame.src = url.href;
      frame.allow = "microphone; autoplay";
      frame.title = options.title || "Talking avatar";
      frame.style.cssText = "border:0;width:100%;height:100%;display:block";
      this.frame = frame;

      this.onMessage = (event) => this.receive(event);
      window.addEventListener("message", this.onMessage);
      frame.addEventListener("load", () => this.onLoad());
      container.append(frame);
    }

    onLoad() {
      // Ask again in case "ready" went out before we could be told the frame's origin.
      this.deliver({ type: "hello" });
      clearTimeout(this.readyTimer);
      if (this.ready) return;
      this.readyTimer = setTimeout(() => {
        if (this.ready) return;
        this.emit({
          type: "error",
          code: "embed_blocked",
          message:
            `the avatar did not load from ${this.origin}: is this page's origin ` +
            `(${location.origin}) one the server allows (--allowed-origin)?`,
        });
      }, READY_GRACE_MS);
    }

    receive(event) {
      if (!this.frame || event.source !== this.frame.contentWindow) return;
      if (event.origin !== this.origin) return;
      const message = event.data;
      if (typeof message !== "object" || message === null || message.avatarRtc !== PROTOCOL) return;
      if (typeof message.type !== "string") return;
      if (message.type === "ready") {
        if (this.ready) return;
        this.ready = true;
        clearTimeout(this.readyTimer);
        const queued = this.queue;
        this.queue = [];
        queued.forEach((command) => this.deliver(command));
      }
      const { avatarRtc, ...detail } = message;
      this.emit(detail);
    }

    emit(event) {
      for (const key of [event.type, "*"]) {
        for (const fn of this.listeners.get(key) || []) {
          try {
            fn(event);
          } catch (err) {
            setTimeout(() => {
              throw err;
            });
          }
        }
      }
    }

    deliver(command) {
      const target = this.frame && this.frame.contentWindow;
      if (target) target.postMessage({ ...command, avatarRtc: PROTOCOL }, this.origin);
    }

    /** Sends a command now, or once the avatar page says it is ready. */
    command(command) {
      if (this.ready) this.deliver(command);
      else this.queue.push(command);
      return this;
    }

    start(token) {
      const chosen = token || this.token;
      return this.command(chosen ? { type: "start", token: chosen } : { type: "start" });
    }

    stop() {
      return this.command({ type: "stop" });
    }

    /** The avatar speaks these words. */
    say(text) {
      return this.command({ type: "say", text: String(text) });
    }

    /** A typed user turn: the avatar answers it as if it had been spoken. */
    text(text) {
      return this.command({ type: "text", text: String(text) });
    }

    interrupt() {
      return this.command({ type: "interrupt" });
    }

    on(type, fn) {
      if (!this.listeners.has(type)) this.listeners.set(type, new Set());
      this.listeners.get(type).add(fn);
      return this;
    }

    off(type, fn) {
      const set = this.listeners.get(type);
      if (set) set.delete(fn);
      return this;
    }

    /** Ends the call and removes the frame. */
    destroy() {
      clearTimeout(this.readyTimer);
      window.removeEventListener("message", this.onMessage);
      if (this.frame) this.frame.remove();
      this.frame = null;
      this.ready = false;
      this.queue = [];
    }
  }

  window.AvatarRTC = {
    version: PROTOCOL,
    Avatar,
    embed(container, options) {
      return new Avatar(container, options);
    },
  };
})();
