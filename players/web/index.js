// @voicebus/player: plays one voicebus session in a browser page. It speaks the edge protocol
// (docs/protocol.md) over a WebSocket, plays the audio through the voicebus-player AudioWorklet
// (worklet.js, PCM16 directly, Opus through WebCodecs), syncs its clock with the edge, follows
// redirects and reconnects with `resume`, and reports when each turn became audible and, when it
// ends or stops, how far it was rendered (the edge turns that into what the listener heard).
// The web player (player.js) and the demo console (console.js) are pages built on it.
// An ES module, no build step, no dependencies; types in index.d.ts.
//
//   import { createPlayer } from "@voicebus/player";
//   const player = createPlayer({ edgeUrl: "wss://edge.example.com/ws", session, token });
//   player.on("caption", ({ words, index }) => show(words, index));
//   button.onclick = () => player.start();   // browsers start audio only after a user gesture

import {
  EdgeClock, edgeAllowed, JITTER_MS, parseAudioFrame, parseOrigins, pcm16Samples, startAudio,
} from "./edge-client.js";
import { CLOSE, ENCODING_OPUS, FLAG_LAST_IN_TURN, HEADER_BYTES, MSG, PROTOCOL_VERSION } from "./protocol.js";

export * from "./protocol.js";
export {
  EdgeClock, edgeAllowed, edgeOrigin, JITTER_MS, parseAudioFrame, parseOrigins, pcm16Samples, waveView,
} from "./edge-client.js";

const REDIRECT_HOPS_AT_ONCE = 3; // then 1 s between hops (two edges can disagree during a rebalance)
const LOST_RECONNECT_MS = 500;
const MOVED_RECONNECT_MS = 100;
const BUSY_RETRY_MS = 1000;
const CLOSE_ABNORMAL = 1006; // no close frame: the edge is gone (never sent by a server)

// A player of one session. Options (index.d.ts: PlayerOptions): `session`, `token` (the edge's
// token for that session: it travels only inside the WebSocket hello), `edgeUrl` (the edge's /ws;
// default "/ws" on the page's origin; http(s) URLs are taken as ws(s)), `allowedOrigins` (edge
// origins besides edgeUrl's own that redirects and `ready` may send the player to), `workletUrl`,
// `jitterMs`, `reconnect` (default true).
export function createPlayer(options) {
  return new Player(options);
}

export class Player {
  constructor({
    session, token, edgeUrl = "/ws", allowedOrigins = [], workletUrl, jitterMs = JITTER_MS, reconnect = true,
  } = {}) {
    if (typeof session !== "string" || !session) throw new TypeError("createPlayer: `session` is required");
    if (typeof token !== "string" || !token) throw new TypeError("createPlayer: `token` is required");
    this.session = session;
    this.token = token;
    this.options = { workletUrl, jitterMs, reconnect };
    this.listeners = new Map(); // event type -> Set of listeners
    this.state = "idle"; // idle, connecting, ready, closed
    this.clientId = null;
    this.edge = null; // the id of the edge connected to (Kafka edges)
    this.clock = new EdgeClock(); // the connected edge's clock
    this.turns = new Map(); // turn number -> {turnId, timeline, audibleAtUs, words: Map(sentence -> [{text, start, end}]), endReason}
    this.turnIds = new Map(); // turn id -> turn number (the same turn keeps its number across edges)
    this.connTurns = new Map(); // this connection's turn number -> the player's (each edge numbers its own)
    this.turnCount = 0;
    this.received = new Map(); // turn id -> Set of "sentence:chunk" received: a replay after a reconnect adds only what is missing
    this.cancelled = new Set(); // turn ids cancelled before this player knew them: their audio is dropped
    this.duplicates = 0; // frames dropped because they had been received already (a resume's replay)
    // Sharded edges (docs/protocol.md, "Sharded edges"): the edge first connected to, the one
    // connected to now, every edge the last ready listed (tried in turn when the connected one is
    // gone), the redirects followed, the origins besides the entry edge's own that may be followed,
    // and the edge URLs refused because their origin is neither ({url, why: "redirect" | "ready"}, the last 100).
    const allowed = Array.isArray(allowedOrigins) ? parseOrigins(allowedOrigins.join(",")) : parseOrigins(allowedOrigins);
    this.edges = { entry: toWebSocketUrl(edgeUrl), url: null, known: [], redirects: [], connections: [], allowed, refused: [] };
    this.redirectTo = null; // where the close 4307 that follows a redirect sends the player (null: nowhere)
    this.redirectRefused = null; // the redirect of this connection that was refused
    this.current = null; // {turn, sentence} being played
    this.lastFinished = null; // turn id of the last turn played to its end (or stopped): a reconnect between turns resumes after it
    this.lastHello = null;
    this.reports = []; // the reports sent (the last 1000)
    this.errors = []; // {code, message}: the edge's error messages and the player's own faults
    this.stats = {}; // the worklet's: peak, stops, underruns, quantaSinceStop, loudQuantaSinceStop
    this.framesReceived = 0;
    this.ctx = null; // the AudioContext, once started
    this.node = null; // the voicebus-player AudioWorkletNode
    this.ws = null;
    this.captionKey = null;
    this.starting = null; // start()'s promise
    this.closed = false; // close() was called: nothing reconnects
    this.opus = { decoder: null, pending: [], timestampUs: 0, outputRate: 0 };
  }

  // --- events -----------------------------------------------------------------------------------
  // on(type, listener) -> a function that removes it. Types and their payloads: index.d.ts (PlayerEvents).
  on(type, listener) {
    if (!this.listeners.has(type)) this.listeners.set(type, new Set());
    this.listeners.get(type).add(listener);
    return () => this.off(type, listener);
  }

  off(type, listener) {
    const set = this.listeners.get(type);
    if (set) set.delete(listener);
  }

  emit(type, detail) {
    for (const listener of [...(this.listeners.get(type) || [])]) {
      try {
        listener(detail);
      } catch (err) {
        setTimeout(() => { throw err; }); // the page sees its error; the player goes on
      }
    }
  }

  // --- the public actions ---------------------------------------------------------------------
  // Opens the audio (call it from a user gesture: a click) and connects. Resolves once audio runs
  // and the first connection is under way; `ready` follows. Rejects when audio cannot start.
  start() {
    if (!this.starting) this.starting = this.startOnce();
    return this.starting;
  }

  async startOnce() {
    if (this.closed) return;
    this.state = "connecting";
    try {
      Object.assign(this, await startAudio((msg) => this.onWorklet(msg), this.options));
    } catch (err) {
      this.state = "idle";
      this.starting = null; // another click may try again
      this.fault("audio", String(err));
      throw err;
    }
    this.connect();
  }

  // Barge-in: silences the turn now, here, and asks the edge to cancel it (the edge stops it at
  // every player of the session and tells the agent). Without `turnId`: the turn being played,
  // else every turn of the session the edge knows. Returns the turn id cancelled, or null.
  cancel(turnId) {
    const cur = this.current;
    if (turnId === undefined || turnId === null) {
      turnId = cur && this.turns.get(cur.turn) ? this.turns.get(cur.turn).turnId : null;
    }
    const number = turnId !== null ? this.turnIds.get(turnId) : undefined;
    if (turnId !== null && number === undefined) {
      this.cancelled.add(turnId); // not started here yet: its audio, if any comes, is dropped
      if (this.cancelled.size > 64) this.cancelled.delete(this.cancelled.keys().next().value);
    }
    // Silence now, locally; the edge also sends "stop" and drops what it still has.
    if (this.node && (number !== undefined || turnId === null)) {
      this.node.port.postMessage({ type: "stop", turn: number !== undefined ? number : (cur ? cur.turn : null) });
    }
    this.send(MSG.CANCEL, turnId !== null ? { turn_id: turnId, reason: "barge-in" } : { reason: "barge-in" });
    return turnId;
  }

  // Closes the connection and the audio; the player does not reconnect.
  close() {
    this.closed = true;
    const ws = this.ws;
    this.ws = null;
    if (ws && ws.readyState <= WebSocket.OPEN) ws.close(CLOSE.NORMAL);
    if (this.ctx) this.ctx.close();
    if (this.opus.decoder && this.opus.decoder.state !== "closed") this.opus.decoder.close();
    this.state = "closed";
    this.emit("close", { code: CLOSE.NORMAL, reason: "closed by the page", url: this.edges.url, reconnect: null });
  }

  // --- internals ----------------------------------------------------------------------------------
  send(type, fields = {}) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ type, v: PROTOCOL_VERSION, ...fields }));
    }
  }

  fault(code, message) {
    const error = { code, message };
    this.errors.push(error);
    if (this.errors.length > 1000) this.errors.shift();
    this.emit("error", error);
  }

  contextTimeToServerUs(contextTime) {
    return this.clock.contextTimeToServerUs(this.ctx, contextTime);
  }

  frameToServerUs(frame) {
    return this.contextTimeToServerUs(frame / this.ctx.sampleRate);
  }

  onWorklet(msg) {
    const turn = this.turns.get(msg.turn);
    const about = turn && { turn: msg.turn, turnId: turn.turnId };
    if (msg.type === "wave") {
      this.stats = msg.stats;
      this.emit("wave", { wave: msg.wave, stats: msg.stats });
    } else if (msg.type === "playing") {
      this.current = { turn: msg.turn, sentence: msg.sentence };
      if (turn) this.emit("playing", { ...about, sentenceSeq: msg.sentence });
    } else if (msg.type === "position" && turn) {
      this.caption(turn, msg);
    } else if (msg.type === "sentence_audible" && turn) {
      this.emit("sentenceaudible", { ...about, sentenceSeq: msg.sentence, atUs: this.contextTimeToServerUs(msg.time) });
    } else if (msg.type === "audible" && turn) {
      turn.audibleAtUs = this.contextTimeToServerUs(msg.time);
      this.report("AUDIBLE_START", turn, msg.sentence, turn.audibleAtUs);
      this.emit("audible", { ...about, sentenceSeq: msg.sentence, atUs: turn.audibleAtUs });
    } else if (msg.type === "ended" && turn) {
      const atUs = this.frameToServerUs(msg.frame);
      this.report("PLAYBACK_END", turn, 0, atUs, msg.rendered);
      this.current = null;
      this.lastFinished = turn.turnId;
      this.turnEnd(turn, { ...about, stopped: false, reason: turn.endReason, atUs, rendered: renderedOf(msg) });
    } else if (msg.type === "underrun" && turn) {
      const atUs = this.frameToServerUs(msg.frame);
      this.report("UNDERRUN", turn, msg.sentence, atUs);
      this.emit("underrun", { ...about, sentenceSeq: msg.sentence, atUs });
    } else if (msg.type === "stopped" && turn) {
      const atUs = this.frameToServerUs(msg.frame);
      this.report("STOPPED", turn, 0, atUs, msg.rendered);
      this.lastFinished = turn.turnId;
      this.turnEnd(turn, { ...about, stopped: true, reason: turn.stopReason || "barge-in", atUs, rendered: renderedOf(msg) });
    }
  }

  // `turnend` once per turn (a barge-in between turns stops the turn played last once more).
  turnEnd(turn, detail) {
    if (turn.finished) return;
    turn.finished = true;
    this.emit("turnend", detail);
  }

  // `rendered` ({sentence, samples}: how far the worklet rendered the turn) makes the report a heard
  // report: the edge publishes what the listener heard from it (TurnHeard).
  report(kind, turn, sentence, atUs, rendered) {
    const r = { kind, turn_id: turn.turnId, sentence_seq: sentence, audible_at_us: atUs };
    if (rendered) {
      r.rendered_sentence_seq = rendered.sentence;
      r.rendered_samples = rendered.samples;
    }
    this.reports.push(r);
    if (this.reports.length > 1000) this.reports.shift();
    this.send(MSG.REPORT, r);
  }

  // Each edge numbers the turns of its connection; the player keeps one number per turn id.
  turnOf(connTurn) {
    return this.connTurns.has(connTurn) ? this.connTurns.get(connTurn) : connTurn;
  }

  onAudio(buffer) {
    const frame = parseAudioFrame(buffer);
    if (!frame || !this.node) return;
    const turn = this.turnOf(frame.turn), { sentence, chunk, flags } = frame;
    const t = this.turns.get(turn);
    if (t) {
      if (this.cancelled.has(t.turnId)) return;
      // A resume replays from the start of the sentence being played: keep only what did not come yet.
      let got = this.received.get(t.turnId);
      if (!got) {
        got = new Set();
        this.received.set(t.turnId, got);
        if (this.received.size > 8) this.received.delete(this.received.keys().next().value);
      }
      const key = `${sentence}:${chunk}`;
      if (got.has(key)) {
        this.duplicates += 1;
        return;
      }
      got.add(key);
    }
    if (frame.encoding === ENCODING_OPUS) return this.onOpus(frame.view, turn, sentence, flags);
    const samples = pcm16Samples(buffer);
    this.framesReceived += 1;
    this.play(turn, sentence, samples);
    if (flags & FLAG_LAST_IN_TURN) this.node.port.postMessage({ type: "end", turn });
  }

  play(turn, sentence, samples) {
    const count = samples.length;
    this.node.port.postMessage({ type: "chunk", turn, sentence, samples }, [samples.buffer]);
    const t = this.turns.get(turn);
    if (t) this.emit("audio", { turn, turnId: t.turnId, sentenceSeq: sentence, samples: count });
  }

  // --- live captions: the word whose start the worklet rendered last ---------------------------
  caption(turn, pos) {
    const words = (turn.words && turn.words.get(pos.sentence)) || [];
    let index = -1;
    while (index + 1 < words.length && words[index + 1].start <= pos.samples) index += 1;
    const key = `${turn.turnId}:${pos.sentence}:${index}`;
    if (index < 0 || this.captionKey === key) return;
    this.captionKey = key;
    this.emit("caption", {
      turn: pos.turn, turnId: turn.turnId, sentenceSeq: pos.sentence, words, index, word: words[index],
      samples: pos.samples, frame: pos.frame,
    });
  }

  // --- Opus (encoding 2): WebCodecs decodes, the worklet plays -----------------------------------
  // A frame holds whole Opus packets, each behind a u16 little-endian length. AudioDecoder answers
  // asynchronously but in order, so each frame waits in `pending` until all its packets are decoded,
  // and a turn's end waits behind its audio: the worklet gets both in the order the edge sent them.
  opusDecoder(sampleRate) {
    const opus = this.opus;
    if (opus.decoder && opus.decoder.state === "configured") return opus.decoder;
    opus.decoder = new AudioDecoder({
      output: (data) => this.onOpusOutput(data),
      error: (err) => {
        this.fault("opus", `Opus decoding failed: ${err}`);
        opus.decoder = null; // the next frame opens a new one; what waits is let through
        for (const item of opus.pending) item.remaining = 0;
        this.flushOpus();
      },
    });
    opus.decoder.configure({ codec: "opus", sampleRate, numberOfChannels: 1 });
    return opus.decoder;
  }

  onOpus(view, turn, sentence, flags) {
    const opus = this.opus;
    this.framesReceived += 1;
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
      const decoder = this.opusDecoder(sampleRate);
      for (const data of packets) {
        decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: opus.timestampUs, data }));
        opus.timestampUs += 20000;
      }
    }
    this.flushOpus();
  }

  onOpusOutput(data) {
    const opus = this.opus;
    const samples = new Float32Array(data.numberOfFrames);
    data.copyTo(samples, { planeIndex: 0, format: "f32-planar" });
    opus.outputRate = data.sampleRate;
    data.close();
    const item = opus.pending.find((it) => it.remaining > 0);
    if (!item) return;
    item.parts.push(resample(samples, opus.outputRate, this.ctx.sampleRate));
    item.remaining -= 1;
    this.flushOpus();
  }

  flushOpus() {
    const opus = this.opus;
    while (opus.pending.length && opus.pending[0].remaining === 0) {
      const item = opus.pending.shift();
      if (item.post) {
        this.node.port.postMessage(item.post);
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
        this.play(item.turn, item.sentence, samples);
      }
      if (item.end) this.node.port.postMessage({ type: "end", turn: item.turn });
    }
  }

  // A turn's end goes to the worklet after the audio still being decoded (none for PCM).
  postAfterAudio(msg) {
    if (this.opus.pending.length) this.opus.pending.push({ remaining: 0, post: msg });
    else this.node.port.postMessage(msg);
  }

  // --- protocol -----------------------------------------------------------------------------------
  onControl(msg) {
    switch (msg.type) {
      case MSG.READY: {
        this.state = "ready";
        this.clientId = msg.client_id;
        this.edge = msg.edge || null;
        this.edges.redirects = [];
        if (Array.isArray(msg.edges)) {
          // only edges this player may follow are tried when this one is gone
          const listed = msg.edges.map((u) => this.resolveEdgeUrl(u));
          for (const u of listed) if (!this.mayFollow(u)) this.refuse(u, "ready");
          this.edges.known = listed.filter((u) => this.mayFollow(u));
        }
        this.clock.onReady(msg.server_time_us);
        for (let i = 0; i < 5; i++) setTimeout(() => this.send(MSG.PING, { t0: performance.now() }), 100 * i);
        this.emit("ready", { session: msg.session, clientId: msg.client_id, edge: this.edge, url: this.edges.url });
        break;
      }
      case MSG.PONG:
        this.clock.onPong(msg);
        break;
      case MSG.TURN_START: {
        let number = this.turnIds.get(msg.turn_id);
        const known = number !== undefined;
        if (!known) {
          number = ++this.turnCount;
          this.turns.set(number, { turnId: msg.turn_id, timeline: {}, audibleAtUs: null, words: new Map(), endReason: null, stopReason: null, finished: false });
          this.turnIds.set(msg.turn_id, number);
          if (this.turns.size > 256) {
            const [oldest, old] = this.turns.entries().next().value;
            this.turns.delete(oldest);
            this.turnIds.delete(old.turnId);
          }
        }
        this.connTurns.set(msg.turn, number);
        if (!known) this.emit("turnstart", { turn: number, turnId: msg.turn_id, sampleRate: msg.sample_rate });
        break;
      }
      case MSG.TIMELINE: {
        const number = this.turnOf(msg.turn), turn = this.turns.get(number);
        if (!turn) break;
        if (!turn.timeline.sent_at_us) turn.timeline = msg; // the turn's first sentence
        this.emit("timeline", { turn: number, turnId: turn.turnId, sentenceSeq: msg.sentence_seq, timeline: msg });
        break;
      }
      case MSG.WORDS: {
        const number = this.turnOf(msg.turn), turn = this.turns.get(number);
        if (!turn) break;
        const known = turn.words.get(msg.sentence_seq) || [];
        if (known.some((w) => w.start === (msg.words[0] || {}).start)) break; // replayed: known already
        const words = known.concat(msg.words).sort((a, b) => a.start - b.start);
        turn.words.set(msg.sentence_seq, words);
        this.emit("words", { turn: number, turnId: turn.turnId, sentenceSeq: msg.sentence_seq, words });
        break;
      }
      case MSG.TURN_END: {
        const number = this.turnOf(msg.turn), turn = this.turns.get(number);
        if (turn) turn.endReason = msg.reason || null;
        this.postAfterAudio({ type: "end", turn: number });
        if (turn) this.emit("turnreceived", { turn: number, turnId: turn.turnId, reason: msg.reason || null });
        break;
      }
      case MSG.STOP: {
        const number = this.turnOf(msg.turn), turn = this.turns.get(number);
        if (turn) turn.stopReason = msg.reason || "stop";
        this.node.port.postMessage({ type: "stop", turn: number });
        break;
      }
      case MSG.REDIRECT: {
        // This edge does not own the session: the close (4307) that follows sends us to the owner,
        // if the owner's origin is the entry edge's or one the player allows (never the token to another).
        const to = this.resolveEdgeUrl(msg.url);
        const followed = this.mayFollow(to);
        this.redirectTo = followed ? to : null;
        if (!followed) {
          this.redirectRefused = to;
          this.refuse(to, "redirect");
        }
        this.emit("redirect", { url: to, followed });
        break;
      }
      case MSG.RECONNECT:
        this.emit("moved", { reason: msg.reason });
        break;
      case MSG.SKIP:
        this.emit("skip", { turnId: msg.turn_id, sentenceSeq: msg.sentence_seq });
        break;
      case MSG.ERROR:
        this.fault(msg.code, msg.message);
        break;
    }
  }

  // A redirect's or a ready's edge URL: absolute (ws://edge-2:8765/ws) or a path on the entry
  // edge's origin (/edge-2/ws: edges behind one proxy). "" for what is not a URL.
  resolveEdgeUrl(u) {
    try {
      return toWebSocketUrl(new URL(String(u), this.edges.entry).href);
    } catch {
      return "";
    }
  }

  // The redirect allow-list (edge-client.js: edgeAllowed): the entry edge's origin, or one allowed.
  mayFollow(url) {
    return edgeAllowed(url, this.edges.entry, this.edges.allowed);
  }

  refuse(url, why) {
    this.edges.refused.push({ url, why });
    if (this.edges.refused.length > 100) this.edges.refused.shift();
    console.warn(`voicebus player: not following ${why === "ready" ? "the listed edge" : "the redirect to"} ${url}: ` +
      "its origin is neither the entry edge's nor an allowed one");
  }

  // After a connection is lost: the next edge to try. The one that failed goes last; the entry
  // edge and every edge the last ready listed are tried in turn. Any of them redirects to the owner.
  nextEdge(failed) {
    const all = [...new Set([this.edges.entry, ...this.edges.known])];
    const at = all.indexOf(failed);
    return at < 0 ? all[0] : all[(at + 1) % all.length];
  }

  connect(url) {
    if (this.closed) return;
    url = url || this.edges.entry;
    this.state = "connecting";
    this.edges.url = url;
    this.edges.connections.push(url);
    if (this.edges.connections.length > 100) this.edges.connections.shift();
    this.redirectTo = null;
    this.redirectRefused = null;
    this.connTurns = new Map();
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    ws.onopen = () => {
      const hello = { session: this.session, token: this.token };
      const cur = this.current && this.turns.get(this.current.turn);
      if (cur) hello.resume = { turn_id: cur.turnId, sentence_seq: this.current.sentence };
      // between turns: the last one was heard (or stopped); a turn spoken while this player had no
      // connection, even one that ended meanwhile, comes after it and is still to be heard
      else if (this.lastFinished) hello.resume = { turn_id: this.lastFinished, sentence_seq: 0, finished: true };
      this.lastHello = hello;
      this.send(MSG.HELLO, hello);
    };
    ws.onmessage = (e) => (typeof e.data === "string" ? this.onControl(JSON.parse(e.data)) : this.onAudio(e.data));
    ws.onclose = (e) => {
      if (this.ws !== ws) return;
      this.state = "closed";
      // Every reconnect says hello with resume: the edge replays the turn from the sentence being played.
      let next = null, delayMs = 0, why = null;
      if (e.code === CLOSE.REDIRECT && this.redirectTo) {
        next = this.redirectTo;
        this.edges.redirects.push(next);
        why = "redirect";
        delayMs = this.edges.redirects.length > REDIRECT_HOPS_AT_ONCE ? 1000 : 0;
      } else if (e.code === CLOSE.REDIRECT && this.redirectRefused !== null) {
        // the redirect event said which redirect was refused; nothing else is tried (any edge sends us there)
      } else if (!this.options.reconnect) {
        // the page reconnects itself, if it wants to
      } else if (e.code === CLOSE.SERVICE_RESTART) {
        [next, delayMs, why] = [this.edges.entry, MOVED_RECONNECT_MS, "moved"];
      } else if (e.code === CLOSE.TRY_AGAIN_LATER) {
        [next, delayMs, why] = [url, BUSY_RETRY_MS, "busy"];
      } else if (e.code === CLOSE_ABNORMAL || e.code === CLOSE.GOING_AWAY) {
        // the edge is gone (or never answered): the next one; any edge redirects to the owner
        [next, delayMs, why] = [this.nextEdge(url), LOST_RECONNECT_MS, "lost"];
      }
      this.emit("close", { code: e.code, reason: e.reason, url, reconnect: next ? { url: next, delayMs, why } : null });
      if (next) setTimeout(() => this.connect(next), delayMs);
    };
  }
}

// An edge URL as a WebSocket URL: relative to the page, http(s) written as ws(s).
function toWebSocketUrl(u) {
  const url = new URL(String(u), globalThis.location ? globalThis.location.href : undefined);
  if (url.protocol === "http:") url.protocol = "ws:";
  else if (url.protocol === "https:") url.protocol = "wss:";
  return url.href;
}

function renderedOf(msg) {
  return msg.rendered ? { sentenceSeq: msg.rendered.sentence, samples: msg.rendered.samples } : null;
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
