// The building blocks of the player (index.js, which the web player, player.js, and the demo
// console, console.js, both use): the binary audio frame of the player protocol (docs/protocol.md;
// the Python side is players/protocol.py), the clock sync with the edge, the AudioWorklet that
// plays and reports, the live wave view and the edges a player may follow. An ES module, no build
// step, no dependencies.

// The protocol's constants come from players/protocol.py, generated into protocol.js.
import { FRAME_AUDIO, HEADER_BYTES, PROTOCOL_VERSION } from "./protocol.js";

export * from "./protocol.js";
export const JITTER_MS = 60;

// An audio frame's header, or null for a frame of another type or protocol version (skipped).
export function parseAudioFrame(buffer) {
  const view = new DataView(buffer);
  if (buffer.byteLength < HEADER_BYTES) return null;
  if (view.getUint8(0) !== FRAME_AUDIO || view.getUint8(1) !== PROTOCOL_VERSION) return null;
  return {
    view,
    flags: view.getUint8(2),
    encoding: view.getUint8(3),
    turn: view.getUint32(4, true),
    sentence: view.getUint32(8, true),
    chunk: view.getUint32(12, true),
    sampleRate: view.getUint32(16, true),
  };
}

// A PCM16LE frame's samples as floats in [-1, 1).
export function pcm16Samples(buffer) {
  const pcm = new Int16Array(buffer, HEADER_BYTES, (buffer.byteLength - HEADER_BYTES) / 2);
  const samples = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
  return samples;
}

export const clientNowUs = () => (performance.timeOrigin + performance.now()) * 1000;

// The edge's clock as seen from the page, NTP-like: the ping/pong exchange with the smallest round
// trip sets the offset. Each edge connected to has its own clock and its own round trip, so a
// `ready` starts the estimate again (after a redirect or a failover to another edge the previous
// edge's best round trip would keep the new edge's pongs from ever refining the offset).
export class EdgeClock {
  constructor() {
    this.offsetUs = 0;
    this.rttUs = Infinity;
    this.samples = 0; // pongs from the edge connected now
  }

  // `ready` from an edge: a first estimate from its server time, to be refined by pongs.
  onReady(serverTimeUs) {
    this.offsetUs = serverTimeUs - clientNowUs();
    this.rttUs = Infinity;
    this.samples = 0;
  }

  onPong(msg, nowMs = performance.now()) {
    const rttUs = (nowMs - msg.t0) * 1000;
    this.samples += 1;
    if (rttUs <= this.rttUs) {
      this.rttUs = rttUs;
      this.offsetUs = msg.server_time_us - (performance.timeOrigin + (msg.t0 + nowMs) / 2) * 1000;
    }
  }

  serverNowUs() {
    return clientNowUs() + this.offsetUs;
  }

  // A context time (seconds) of a rendered sample -> the edge's epoch microseconds, rounded.
  contextTimeToServerUs(ctx, contextTime) {
    const ts = ctx.getOutputTimestamp();
    const perfMs = ts.performanceTime + (contextTime - ts.contextTime) * 1000;
    return Math.round((performance.timeOrigin + perfMs) * 1000 + this.offsetUs);
  }
}

// The AudioContext and the voicebus-player worklet (worklet.js), started; `onMessage` gets what
// the worklet reports (playing, audible, position, ended, stopped, underrun, wave). The worklet is
// loaded from beside this module (`workletUrl` overrides it: a bundler that moves the files).
export async function startAudio(onMessage, { workletUrl = new URL("./worklet.js", import.meta.url), jitterMs = JITTER_MS } = {}) {
  const ctx = new AudioContext({ sampleRate: 24000, latencyHint: "interactive" });
  await ctx.audioWorklet.addModule(String(workletUrl));
  const node = new AudioWorkletNode(ctx, "voicebus-player", {
    numberOfInputs: 0,
    outputChannelCount: [1],
    processorOptions: { jitterMs },
  });
  node.connect(ctx.destination);
  node.port.onmessage = (e) => onMessage(e.data);
  await ctx.resume();
  return { ctx, node };
}

// The live wave: the worklet's (min, max) pairs, one pixel column each, newest on the right.
export function waveView(canvas) {
  const history = [];
  return (pairs) => {
    for (let i = 0; i < pairs.length; i += 2) history.push([pairs[i], pairs[i + 1]]);
    while (history.length > canvas.width) history.shift();
    const g = canvas.getContext("2d");
    g.fillStyle = "#111";
    g.fillRect(0, 0, canvas.width, canvas.height);
    g.strokeStyle = "#4c8";
    g.beginPath();
    const mid = canvas.height / 2;
    history.forEach(([lo, hi], x) => {
      g.moveTo(x + 0.5, mid - hi * mid);
      g.lineTo(x + 0.5, mid - lo * mid + 1);
    });
    g.stroke();
  };
}

// --- the edges a page may be sent to (docs/security.md, "The player's edges") ----------------
// A redirect (close 4307) or a `ready`'s `edges` names an edge's /ws; the player follows it only to
// the page's own origin (the entry edge's host:port) or to an origin the page allows: the
// `data-edge-origins` attribute of its <html> element, comma-separated ("https://edge-2.example.com"),
// which the edge fills from VOICEBUS_EDGE_REDIRECT_ORIGINS.

// The origin of an absolute URL, ws/wss written as http/https ("http://edge-2:8765"); "" otherwise.
export function edgeOrigin(u) {
  let url;
  try {
    url = new URL(String(u));
  } catch {
    return "";
  }
  const scheme = { "ws:": "http:", "wss:": "https:", "http:": "http:", "https:": "https:" }[url.protocol];
  return scheme && url.host ? `${scheme}//${url.host}` : ""; // URL.host: lower case, no default port
}

// A comma-separated list of origins, normalized as edgeOrigin writes them; entries that are not
// absolute http(s)/ws(s) origins are dropped.
export function parseOrigins(list) {
  return String(list || "").split(",").map((o) => edgeOrigin(o.trim())).filter(Boolean);
}

// Whether an edge URL (absolute, as the player resolved it) may be followed from `pageUrl`.
export function edgeAllowed(url, pageUrl, allowedOrigins) {
  const origin = edgeOrigin(url);
  return origin !== "" && (origin === edgeOrigin(pageUrl) || allowedOrigins.includes(origin));
}
