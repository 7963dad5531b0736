// What a page written in TypeScript does with the client library: checked against
// static/call.d.ts and static/embed-host.d.ts by `make lint-js` (tsc), so the declarations
// keep matching the way the modules are used. Never run.
import {
  Call,
  MICROPHONE_CONSTRAINTS,
  StatsSampler,
  backoffMs,
  listMicrophones,
  type ServerEvent,
} from "../../static/call.js";
import { AvatarEmbed, embed, type EmbedEvent } from "../../static/embed-host.js";

export async function talk(video: HTMLVideoElement, picker: HTMLSelectElement): Promise<void> {
  const call = new Call(video, { baseUrl: "https://avatar.example.com", iceTransportPolicy: "relay" });
  call.addEventListener("event", (e) => {
    const event: ServerEvent = e.detail;
    if (event.type === "response") console.log(String(event.text));
  });
  call.addEventListener("reconnecting", (e) => console.log(e.detail.attempt, e.detail.delayMs));
  call.addEventListener("closed", (e) => console.log(e.detail.reason.length));
  call.addEventListener("microphone", (e) => {
    picker.value = e.detail.deviceId;
  });
  await call.start();
  const sent: boolean = call.send({ type: "text", text: "Hello" });
  for (const mic of await listMicrophones()) picker.add(new Option(mic.label, mic.deviceId));
  await call.switchMicrophone(picker.value || null);
  call.setMicrophoneEnabled(!call.microphoneEnabled);
  const level: number = call.microphoneLevel() + backoffMs(1);
  const echo: true = MICROPHONE_CONSTRAINTS.echoCancellation;
  const stats = await new StatsSampler().sample(call.pc as RTCPeerConnection);
  console.log(sent, level, echo, stats.fps ?? 0, call.sessionId?.length);
  await call.stop();
}

export function frame(container: HTMLElement): AvatarEmbed {
  const avatar = embed(container, { server: "https://avatar.example.com", theme: "light" });
  avatar.on("*", (e: EmbedEvent) => console.log(e.type)).start().say("Hi").interrupt();
  const global: AvatarEmbed = window.AvatarRTC.embed(container, { autostart: true });
  return global === avatar ? avatar : new AvatarEmbed(container);
}
