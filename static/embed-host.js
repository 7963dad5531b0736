// The embed as an ES module, for pages that bundle or import their scripts:
//
//   import { embed } from "avatar-rtc-client/embed";
//   const avatar = embed(document.querySelector("#avatar"), { server: "https://avatar.example.com" });
//   avatar.on("response", (e) => console.log(e.text)).start();
//
// The code is embed.js's (one source for both forms): importing this runs it, which also
// defines window.AvatarRTC. A module has no script address to default to, so `server` is needed.
import "./embed.js";

const { Avatar, embed, version } = window.AvatarRTC;

export { Avatar as AvatarEmbed, embed, version };
