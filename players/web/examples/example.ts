// A TypeScript app that plays a voicebus session with @voicebus/player. It is also the package's
// type test: `tsc -p examples` (npm run check-types) must accept it, and each line marked as an
// expected error below must be one.
import { CLOSE, MSG, createPlayer, waveView, type Player, type PlayerEvents, type Word } from "@voicebus/player";
import { PROTOCOL_VERSION, REPORT_KIND, type ReportKind } from "@voicebus/player/protocol";

export function play(edgeUrl: string, session: string, token: string, button: HTMLButtonElement,
                     caption: HTMLElement, canvas: HTMLCanvasElement): Player {
  const player = createPlayer({ edgeUrl, session, token, allowedOrigins: ["https://edge-2.example.com"] });
  const draw = waveView(canvas);

  player.on("ready", ({ clientId, edge }) => console.log(`connected as ${clientId} to ${edge ?? "the edge"}`));
  player.on("turnstart", ({ turnId, turn }) => console.log(`turn ${turn}: ${turnId}`));
  player.on("words", ({ sentenceSeq, words }) => console.log(sentenceSeq, words.map((w: Word) => w.text).join(" ")));
  player.on("caption", ({ words, index }) => {
    caption.textContent = words.map((w, k) => (k === index ? `[${w.text}]` : w.text)).join(" ");
  });
  player.on("turnend", ({ turnId, stopped, rendered }) => {
    const heard: number = rendered ? rendered.samples : 0;
    console.log(`${turnId} ${stopped ? "stopped" : "ended"} after ${heard} samples of its last sentence`);
  });
  player.on("wave", ({ wave }) => draw(wave));
  const off = player.on("error", ({ code, message }) => console.error(code, message));
  player.on("close", ({ code, reconnect }) => {
    if (code === CLOSE.UNAUTHORIZED) off();
    if (reconnect) console.log(`reconnecting to ${reconnect.url} (${reconnect.why}) in ${reconnect.delayMs} ms`);
  });

  button.onclick = () => {
    if (player.state === "idle") void player.start();
    else {
      const cancelled: string | null = player.cancel();
      console.log("barged in on", cancelled);
    }
  };

  const version: 1 = PROTOCOL_VERSION;
  const kind: ReportKind = REPORT_KIND.STOPPED;
  const hello: "hello" = MSG.HELLO;
  const detail: PlayerEvents["turnend"]["reason"] = null;
  console.log(version, kind, hello, detail);

  // The types are not `any`: each of these is an error.
  // @ts-expect-error: there is no such event
  player.on("turn-start", () => {});
  // @ts-expect-error: a caption's index is a number
  player.on("caption", ({ index }) => index.toUpperCase());
  // @ts-expect-error: the token is required
  createPlayer({ edgeUrl, session });
  // @ts-expect-error: the protocol's constants are literal types
  const other: 2 = PROTOCOL_VERSION;
  console.log(other);
  return player;
}
