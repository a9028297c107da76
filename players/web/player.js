// voicebus web player: speaks the edge protocol (docs/protocol.md) over a WebSocket, plays audio
// through the voicebus-player AudioWorklet, syncs its clock with the edge, and reports when each
// turn became audible and, when it ends or stops, how far it was rendered (the edge turns that
// into what the listener heard). Live captions highlight the word being rendered, driven by the
// worklet's rendered position. No build step, no dependencies.

import {
  EdgeClock, edgeAllowed, ENCODING_OPUS, FLAG_LAST_IN_TURN, HEADER_BYTES, parseOrigins, PROTOCOL_VERSION,
  parseAudioFrame, pcm16Samples, startAudio as startWorklet, waveView,
  MSG, CLOSE,
} from "./edge-client.js";

const $ = (id) => document.getElementById(id);
// The page URL is /#session=S&token=T: a fragment never reaches a server (no access log, proxy or
// Referer sees the token). The token goes to the edge only inside the WebSocket hello.
const fragment = new URLSearchParams(location.hash.slice(1));
const query = new URLSearchParams(location.search);
$("session").value = fragment.get("session") || query.get("session") || "";
$("token").value = fragment.get("token") || "";
const tokenInQuery = query.has("token");

// Everything the page knows, exposed for debugging and for the end-to-end test.
const player = (window.voicebusPlayer = {
  state: "idle",
  clientId: null,
  clock: new EdgeClock(), // the connected edge's clock
  turns: new Map(), // page turn number -> {turnId, timeline: {...}, audibleAtUs, words: Map(sentence -> [{text, start, end}])}
  turnIds: new Map(), // turn id -> page turn number (the same turn keeps its number across edges)
  connTurns: new Map(), // this connection's turn number -> page turn number (each edge numbers its own)
  turnCount: 0,
  received: new Map(), // turn id -> Set of "sentence:chunk" received: a replay after a reconnect adds only what is missing
  duplicates: 0, // frames dropped because they had been received already (a resume's replay)
  // Sharded edges (docs/protocol.md, "Sharded edges"): the page's own edge, the one connected to,
  // every edge the last ready listed (tried in turn when the connected one is gone), the redirects followed,
  // the origins besides the page's own that may be followed (<html data-edge-origins>), and the edge
  // URLs refused because their origin is neither ({url, why: "redirect" | "ready"}, the last 100).
  edges: {
    entry: null, url: null, known: [], redirects: [], connections: [],
    allowed: parseOrigins(document.documentElement.dataset.edgeOrigins), refused: [],
  },
  redirectTo: null, // where the close 4307 that follows a redirect sends the player (null: nowhere)
  redirectRefused: null, // the redirect of this connection that was refused
  current: null, // {turn, sentence} being played
  lastFinished: null, // turn id of the last turn played to its end (or stopped): a reconnect between turns resumes after it
  reports: [],
  bargeIns: [], // server-clock µs of each barge-in click
  captions: [], // every word highlighted: {turn, sentence, index, text, lagMs, postedMs, deliveryMs, shownAtMs} (lag behind its rendered start)
  errors: [],
  stats: {},
  framesReceived: 0,
  ctx: null,
  node: null,
  ws: null,
});

function setStatus(text) {
  $("status").textContent = text;
}

if (tokenInQuery && !fragment.get("token")) {
  // An old-style link (?token=...): that token was already sent to the server and may be logged.
  setStatus("the token in this URL's query (?token=) is not used: it reaches server logs. " +
    "Open the player with #session=S&token=T (voicebus token prints that URL) or paste the token above.");
}

function send(type, fields = {}) {
  if (player.ws && player.ws.readyState === WebSocket.OPEN) {
    player.ws.send(JSON.stringify({ type, v: PROTOCOL_VERSION, ...fields }));
  }
}

// --- clock sync (edge-client.js: EdgeClock) ---------------------------------------------------
function ping() {
  send(MSG.PING, { t0: performance.now() });
}

// --- audio --------------------------------------------------------------------------------
async function startAudio() {
  Object.assign(player, await startWorklet(onWorklet));
}

function contextTimeToServerUs(contextTime) {
  return player.clock.contextTimeToServerUs(player.ctx, contextTime);
}

function onWorklet(msg) {
  const turn = player.turns.get(msg.turn);
  if (msg.type === "wave") {
    player.stats = msg.stats;
    drawWave(msg.wave);
  } else if (msg.type === "playing") {
    player.current = { turn: msg.turn, sentence: msg.sentence };
  } else if (msg.type === "position" && turn) {
    showCaption(turn, msg);
  } else if (msg.type === "audible" && turn) {
    turn.audibleAtUs = contextTimeToServerUs(msg.time);
    report("AUDIBLE_START", turn, msg.sentence, turn.audibleAtUs);
    renderTimeline();
  } else if (msg.type === "ended" && turn) {
    report("PLAYBACK_END", turn, 0, contextTimeToServerUs(msg.frame / player.ctx.sampleRate), msg.rendered);
    player.current = null;
    player.lastFinished = turn.turnId;
  } else if (msg.type === "underrun" && turn) {
    report("UNDERRUN", turn, msg.sentence, contextTimeToServerUs(msg.frame / player.ctx.sampleRate));
  } else if (msg.type === "stopped" && turn) {
    report("STOPPED", turn, 0, contextTimeToServerUs(msg.frame / player.ctx.sampleRate), msg.rendered);
    player.lastFinished = turn.turnId;
  }
}

// `rendered` ({sentence, samples}: how far the worklet rendered the turn) makes the report a heard
// report: the edge publishes what the listener heard from it (TurnHeard).
function report(kind, turn, sentence, atUs, rendered) {
  const r = { kind, turn_id: turn.turnId, sentence_seq: sentence, audible_at_us: atUs };
  if (rendered) {
    r.rendered_sentence_seq = rendered.sentence;
    r.rendered_samples = rendered.samples;
  }
  player.reports.push(r);
  send(MSG.REPORT, r);
}

// Each edge numbers the turns of its connection; the page keeps one number per turn id.
function pageTurn(connTurn) {
  return player.connTurns.has(connTurn) ? player.connTurns.get(connTurn) : connTurn;
}

function onAudio(buffer) {
  const frame = parseAudioFrame(buffer);
  if (!frame) return;
  const turn = pageTurn(frame.turn), { sentence, chunk, flags } = frame;
  const t = player.turns.get(turn);
  if (t) {
    // A resume replays from the start of the sentence being played: keep only what did not come yet.
    let got = player.received.get(t.turnId);
    if (!got) {
      got = new Set();
      player.received.set(t.turnId, got);
      if (player.received.size > 8) player.received.delete(player.received.keys().next().value);
    }
    const key = `${sentence}:${chunk}`;
    if (got.has(key)) {
      player.duplicates += 1;
      return;
    }
    got.add(key);
  }
  if (frame.encoding === ENCODING_OPUS) return onOpus(frame.view, turn, sentence, flags);
  const samples = pcm16Samples(buffer);
  player.framesReceived += 1;
  player.node.port.postMessage({ type: "chunk", turn, sentence, samples }, [samples.buffer]);
  if (flags & FLAG_LAST_IN_TURN) player.node.port.postMessage({ type: "end", turn });
}

// --- live captions: the word whose start the worklet rendered last ---------------------------
function showCaption(turn, pos) {
  const words = (turn.words && turn.words.get(pos.sentence)) || [];
  let index = -1;
  while (index + 1 < words.length && words[index + 1].start <= pos.samples) index += 1;
  const key = `${turn.turnId}:${pos.sentence}:${index}`;
  if (index < 0 || player.captionKey === key) return;
  player.captionKey = key;
  const box = $("captions");
  box.innerHTML = "";
  words.forEach((w, k) => {
    const span = document.createElement("span");
    span.textContent = w.text + " ";
    span.className = k < index ? "heard" : k === index ? "now" : "ahead";
    box.appendChild(span);
  });
  // how much audio had been rendered past the word's start when it was shown (lagMs), in two
  // parts: the worklet's own (the word's start to the position it posted: at most two render
  // quanta) and the browser's (the position message waiting for this page's main thread)
  const msPerFrame = 1000 / player.ctx.sampleRate;
  const renderedFrame = player.ctx.currentTime * player.ctx.sampleRate;
  const startFrame = pos.frame - (pos.samples - words[index].start);
  const lagMs = (renderedFrame - startFrame) * msPerFrame;
  const deliveryMs = (renderedFrame - pos.frame) * msPerFrame;
  player.captions.push({ turn: turn.turnId, sentence: pos.sentence, index, text: words[index].text, lagMs, postedMs: lagMs - deliveryMs, deliveryMs, shownAtMs: performance.now() });
  if (player.captions.length > 1000) player.captions.shift();
}

// --- Opus (encoding 2): WebCodecs decodes, the worklet plays -----------------------------------
// A frame holds whole Opus packets, each behind a u16 little-endian length. AudioDecoder answers
// asynchronously but in order, so each frame waits in `pending` until all its packets are decoded,
// and a turn's end waits behind its audio: the worklet gets both in the order the edge sent them.
const opus = { decoder: null, pending: [], timestampUs: 0, outputRate: 0 };

function opusDecoder(sampleRate) {
  if (opus.decoder && opus.decoder.state === "configured") return opus.decoder;
  opus.decoder = new AudioDecoder({
    output: onOpusOutput,
    error: (err) => {
      player.errors.push({ code: "opus", message: String(err) });
      setStatus(`Opus decoding failed: ${err}`);
      opus.decoder = null; // the next frame opens a new one; what waits is let through
      for (const item of opus.pending) item.remaining = 0;
      flushOpus();
    },
  });
  opus.decoder.configure({ codec: "opus", sampleRate, numberOfChannels: 1 });
  return opus.decoder;
}

function onOpus(view, turn, sentence, flags) {
  player.framesReceived += 1;
  const sampleRate = view.getUint32(16, true);
  const packets = [];
  for (let at = HEADER_BYTES; at + 2 <= view.byteLength; ) {
    const size = view.getUint16(at, true);
    packets.push(new Uint8Array(view.buffer, at + 2, size));
    at += 2 + size;
  }
  const item = { turn, sentence, remaining: packets.length, parts: [], end: Boolean(flags & FLAG_LAST_IN_TURN) };
  opus.pending.push(item);
  if (packets.length) {
    const decoder = opusDecoder(sampleRate);
    for (const data of packets) {
      decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: opus.timestampUs, data }));
      opus.timestampUs += 20000;
    }
  }
  flushOpus();
}

function onOpusOutput(data) {
  const samples = new Float32Array(data.numberOfFrames);
  data.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
  opus.outputRate = data.sampleRate;
  data.close();
  const item = opus.pending.find((it) => it.remaining > 0);
  if (!item) return;
  item.parts.push(resample(samples, opus.outputRate, player.ctx.sampleRate));
  item.remaining -= 1;
  flushOpus();
}

// The decoder's rate -> the context's (libopus decodes at 48 kHz; the context runs at 24 kHz):
// averaging for a whole ratio, linear interpolation otherwise. Opus at 24 kbit/s carries nothing
// above 8-12 kHz, so this loses nothing audible.
function resample(samples, from, to) {
  if (from === to) return samples;
  const ratio = from / to;
  const out = new Float32Array(Math.floor(samples.length / ratio));
  if (Number.isInteger(ratio)) {
    for (let i = 0; i < out.length; i++) {
      let sum = 0;
      for (let k = 0; k < ratio; k++) sum += samples[i * ratio + k];
      out[i] = sum / ratio;
    }
  } else {
    for (let i = 0; i < out.length; i++) {
      const x = i * ratio, j = Math.floor(x), f = x - j;
      out[i] = samples[j] * (1 - f) + (j + 1 < samples.length ? samples[j + 1] : samples[j]) * f;
    }
  }
  return out;
}

function flushOpus() {
  while (opus.pending.length && opus.pending[0].remaining === 0) {
    const item = opus.pending.shift();
    if (item.post) {
      player.node.port.postMessage(item.post);
      continue;
    }
    const n = item.parts.reduce((sum, p) => sum + p.length, 0);
    if (n) {
      const samples = new Float32Array(n);
      let at = 0;
      for (const part of item.parts) {
        samples.set(part, at);
        at += part.length;
      }
      player.node.port.postMessage({ type: "chunk", turn: item.turn, sentence: item.sentence, samples }, [samples.buffer]);
    }
    if (item.end) player.node.port.postMessage({ type: "end", turn: item.turn });
  }
}

// A turn's end goes to the worklet after the audio still being decoded (none for PCM).
function postAfterAudio(msg) {
  if (opus.pending.length) opus.pending.push({ remaining: 0, post: msg });
  else player.node.port.postMessage(msg);
}

// --- protocol -----------------------------------------------------------------------------
function onControl(msg) {
  switch (msg.type) {
    case MSG.READY:
      player.state = "ready";
      player.clientId = msg.client_id;
      player.edge = msg.edge || null;
      player.edges.redirects = [];
      if (Array.isArray(msg.edges)) {
        // only edges this page may follow are tried when this one is gone
        const listed = msg.edges.map((u) => resolveEdgeUrl(u));
        for (const u of listed) if (!mayFollow(u)) refuse(u, "ready");
        player.edges.known = listed.filter(mayFollow);
      }
      player.clock.onReady(msg.server_time_us);
      setStatus(`connected as ${msg.client_id} to session ${msg.session}`);
      $("bargein").disabled = false;
      for (let i = 0; i < 5; i++) setTimeout(ping, 100 * i);
      break;
    case MSG.PONG:
      player.clock.onPong(msg);
      break;
    case MSG.TURN_START: {
      let number = player.turnIds.get(msg.turn_id);
      if (number === undefined) {
        number = ++player.turnCount;
        player.turns.set(number, { turnId: msg.turn_id, timeline: {}, audibleAtUs: null, words: new Map() });
        player.turnIds.set(msg.turn_id, number);
      }
      player.connTurns.set(msg.turn, number);
      renderTimeline();
      break;
    }
    case MSG.TIMELINE: {
      const turn = player.turns.get(pageTurn(msg.turn));
      if (turn && !turn.timeline.sent_at_us) turn.timeline = msg; // the turn's first sentence
      renderTimeline();
      break;
    }
    case MSG.WORDS: {
      const turn = player.turns.get(pageTurn(msg.turn));
      if (turn) {
        const known = turn.words.get(msg.sentence_seq) || [];
        if (known.some((w) => w.start === (msg.words[0] || {}).start)) break; // replayed: known already
        turn.words.set(msg.sentence_seq, known.concat(msg.words).sort((a, b) => a.start - b.start));
      }
      break;
    }
    case MSG.TURN_END:
      postAfterAudio({ type: "end", turn: pageTurn(msg.turn) });
      break;
    case MSG.STOP:
      player.node.port.postMessage({ type: "stop", turn: pageTurn(msg.turn) });
      break;
    case MSG.REDIRECT: {
      // This edge does not own the session: the close (4307) that follows sends us to the owner,
      // if the owner's origin is the page's or one the page allows (never the token to another).
      const to = resolveEdgeUrl(msg.url);
      if (mayFollow(to)) {
        player.redirectTo = to;
      } else {
        player.redirectTo = null;
        player.redirectRefused = to;
        refuse(to, "redirect");
        setStatus(`redirect to ${to || "(no URL)"} refused: not this page's origin nor one it allows ` +
          "(data-edge-origins); not followed");
      }
      break;
    }
    case MSG.RECONNECT:
      setStatus(`session moved (${msg.reason}): reconnecting`);
      break;
    case MSG.SKIP:
      setStatus(`skipped sentence ${msg.sentence_seq} of ${msg.turn_id}: this player fell behind`);
      break;
    case MSG.ERROR:
      player.errors.push(msg);
      setStatus(`error ${msg.code}: ${msg.message}`);
      break;
  }
}

// A redirect's or a ready's edge URL: absolute (ws://edge-2:8765/ws) or a path on the page's
// origin (/edge-2/ws: edges behind one proxy). "" for what is not a URL.
function resolveEdgeUrl(u) {
  const page = new URL(location.href);
  try {
    return new URL(String(u), `${page.protocol === "https:" ? "wss" : "ws"}://${page.host}/`).href;
  } catch {
    return "";
  }
}

// The redirect allow-list (edge-client.js: edgeAllowed): the page's own origin, or one it allows.
function mayFollow(url) {
  return edgeAllowed(url, location.href, player.edges.allowed);
}

function refuse(url, why) {
  player.edges.refused.push({ url, why });
  if (player.edges.refused.length > 100) player.edges.refused.shift();
  console.warn(`voicebus player: not following ${why === "ready" ? "the listed edge" : "the redirect to"} ${url}: ` +
    `its origin is neither this page's nor one in data-edge-origins`);
}

// After a connection is lost: the next edge to try. The one that failed goes last; the page's own
// edge and every edge the last ready listed are tried in turn. Any of them redirects to the owner.
function nextEdge(failed) {
  const all = [...new Set([player.edges.entry, ...player.edges.known])];
  const at = all.indexOf(failed);
  return at < 0 ? all[0] : all[(at + 1) % all.length];
}

function connect(url) {
  if (!player.edges.entry) player.edges.entry = resolveEdgeUrl("/ws");
  url = url || player.edges.entry;
  player.edges.url = url;
  player.edges.connections.push(url);
  if (player.edges.connections.length > 100) player.edges.connections.shift();
  player.redirectTo = null;
  player.redirectRefused = null;
  player.connTurns = new Map();
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  player.ws = ws;
  ws.onopen = () => {
    const hello = { session: $("session").value, token: $("token").value };
    const cur = player.current && player.turns.get(player.current.turn);
    if (cur) hello.resume = { turn_id: cur.turnId, sentence_seq: player.current.sentence };
    // between turns: the last one was heard (or stopped); a turn spoken while this player had no
    // connection, even one that ended meanwhile, comes after it and is still to be heard
    else if (player.lastFinished) hello.resume = { turn_id: player.lastFinished, sentence_seq: 0, finished: true };
    player.lastHello = hello;
    send(MSG.HELLO, hello);
  };
  ws.onmessage = (e) => (typeof e.data === "string" ? onControl(JSON.parse(e.data)) : onAudio(e.data));
  ws.onclose = (e) => {
    if (player.ws !== ws) return;
    player.state = "closed";
    $("bargein").disabled = true;
    // Every reconnect says hello with resume: the edge replays the turn from the sentence being played.
    if (e.code === CLOSE.REDIRECT && player.redirectTo) {
      const to = player.redirectTo;
      player.edges.redirects.push(to);
      setStatus(`redirected to ${to}`);
      // hops without a ready in between are spaced out (two edges that disagree during a rebalance)
      setTimeout(() => connect(to), player.edges.redirects.length > 3 ? 1000 : 0);
    } else if (e.code === CLOSE.REDIRECT && player.redirectRefused !== null) {
      // the status says which redirect was refused; nothing else is tried (any edge sends us there)
    } else if (e.code === CLOSE.SERVICE_RESTART) {
      setStatus("session moved to another edge; reconnecting");
      setTimeout(() => connect(player.edges.entry), 100);
    } else if (e.code === CLOSE.TRY_AGAIN_LATER) {
      setStatus(`edge busy (${e.reason}); retrying`);
      setTimeout(() => connect(url), 1000);
    } else if (e.code === 1006 || e.code === CLOSE.GOING_AWAY) {
      setStatus(`connection lost (${e.code}); reconnecting`);
      // the edge is gone (or never answered): the next one; any edge redirects to the owner
      setTimeout(() => connect(nextEdge(url)), 500);
    } else if (e.code !== 1000) {
      setStatus(`closed ${e.code} ${e.reason}`);
    }
  };
}

function bargeIn() {
  const cur = player.current;
  const turnId = cur && player.turns.get(cur.turn) ? player.turns.get(cur.turn).turnId : undefined;
  player.bargeIns.push(Math.round(player.clock.serverNowUs()));
  // Silence now, locally; the edge also sends "stop" and drops what it still has.
  player.node.port.postMessage({ type: "stop", turn: cur ? cur.turn : null });
  send(MSG.CANCEL, turnId ? { turn_id: turnId, reason: "barge-in" } : { reason: "barge-in" });
}

// --- views --------------------------------------------------------------------------------
const drawWave = waveView($("wave"));

function renderTimeline() {
  const body = $("timeline").querySelector("tbody");
  body.innerHTML = "";
  for (const [number, turn] of player.turns) {
    const t = turn.timeline;
    const base = t.first_token_at_us || t.released_at_us;
    const cells = [t.first_token_at_us, t.released_at_us, t.synthesis_started_at_us, t.audio_ready_at_us, t.sent_at_us, turn.audibleAtUs];
    const row = document.createElement("tr");
    const td = (text) => {
      const c = document.createElement("td");
      c.textContent = text;
      row.appendChild(c);
      return c;
    };
    td(`${number}: ${turn.turnId}`);
    for (const v of cells) td(v && base ? ((v - base) / 1000).toFixed(1) : "");
    const last = cells.filter(Boolean).pop();
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${last && base ? Math.min(300, (last - base) / 10000) : 0}px`;
    td("").appendChild(bar);
    body.appendChild(row);
  }
}

$("start").onclick = async () => {
  $("start").disabled = true;
  try {
    await startAudio();
    connect();
    player.state = "connecting";
    setStatus("connecting");
  } catch (err) {
    player.errors.push({ code: "audio", message: String(err) });
    setStatus(`audio failed: ${err}`);
    $("start").disabled = false;
  }
};
$("bargein").onclick = bargeIn;
