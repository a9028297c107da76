// voicebus demo console: publishes an answer through the console API (players/console.py), hears it
// back over the player protocol (docs/protocol.md) through the voicebus-player AudioWorklet, and
// draws each sentence's way through the pipeline from the edge's timeline messages. Plain file, no
// build step, no dependencies. The console key comes from the URL fragment (#k=...), which never
// reaches a server log; it goes to the edge only in a request header.

import { createPlayer, waveView } from "./index.js";

const PLAY_TIMEOUT_MS = 180000;
const KEY_HEADER = "X-Voicebus-Console-Key";
// [timeline field that ends the segment, css colour, name]; each segment starts where the previous ended.
const SEGMENTS = [
  ["text_complete_at_us", "var(--tok)", "tokens"],
  ["released_at_us", "var(--gate)", "released"],
  ["synthesis_started_at_us", "var(--queue)", "synthesis start"],
  ["audio_ready_at_us", "var(--synth)", "first chunk"],
  ["sent_at_us", "var(--bus)", "sent"],
  ["audibleAtUs", "var(--play)", "audible"],
];

const $ = (id) => document.getElementById(id);
const key = new URLSearchParams(location.hash.slice(1)).get("k") || "";

// Everything the page knows, exposed for debugging and for the browser test.
const con = (window.voicebusConsole = {
  state: "loading",
  session: null,
  token: null,
  conversations: [],
  player: null, // the player (index.js) once audio started: the connection, the worklet, the edge's clock
  clock: null, // the edge's clock (the player's)
  turns: new Map(), // the player's turn number -> turn (see newTurn)
  turnIds: new Map(), // turn id -> the player's turn number
  expected: new Map(), // turn id -> {mode, play} for turns this page published
  plays: [], // {mode, play, turnIds, ttfaMs, done}
  results: { buffered: null, incremental: null },
  current: null, // {turn, sentence} being played
  busy: false,
  errors: [],
  stats: {},
});

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function fail(code, message) {
  con.errors.push({ code, message });
  setStatus(`${code}: ${message}`, true);
}

async function api(path, body = {}) {
  const response = await fetch(`/console/api/${path}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", [KEY_HEADER]: key },
    body: JSON.stringify({ session: con.session, ...body }),
  });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || `${path}: HTTP ${response.status}`);
  return data;
}

// --- the player (index.js): the connection to this edge, the worklet, the edge's clock -------------
// It reports each turn's audible start and, when the turn ends or stops, how far it was rendered.
function newPlayer() {
  const player = createPlayer({ session: con.session, token: con.token });
  Object.assign(con, { player, clock: player.clock });
  player.on("wave", ({ wave, stats }) => {
    con.stats = stats;
    drawWave(wave);
  });
  player.on("playing", ({ turn, sentenceSeq }) => {
    if (!con.turns.has(turn)) return;
    con.current = { turn, sentence: sentenceSeq };
    render();
  });
  player.on("sentenceaudible", ({ turn, sentenceSeq, atUs }) => {
    if (!con.turns.has(turn)) return;
    sentenceOf(con.turns.get(turn), sentenceSeq).audibleAtUs = atUs;
    render();
  });
  player.on("audible", ({ turn, atUs }) => {
    const t = con.turns.get(turn);
    if (!t) return;
    t.audibleAtUs = atUs;
    finishTtfa(t);
    render();
  });
  player.on("turnend", ({ turn, stopped }) => {
    const t = con.turns.get(turn);
    if (!t) return;
    if (stopped) t.stopped = true;
    turnDone(t);
  });
  player.on("audio", ({ turn, sentenceSeq, samples }) => {
    const t = con.turns.get(turn);
    if (!t) return;
    sentenceOf(t, sentenceSeq).samples += samples;
    t.samples += samples;
  });
  player.on("turnstart", ({ turn, turnId }) => {
    con.turns.set(turn, newTurn(turn, turnId));
    con.turnIds.set(turnId, turn);
    render();
  });
  player.on("timeline", ({ turn, sentenceSeq, timeline }) => {
    const t = con.turns.get(turn);
    if (!t) return;
    const s = sentenceOf(t, sentenceSeq);
    s.timeline = timeline;
    if (!t.firstTokenAtUs && timeline.first_token_at_us) t.firstTokenAtUs = timeline.first_token_at_us;
    if (t.bargedAtUs && timeline.synthesis_started_at_us > t.bargedAtUs + 20000) t.lateSentences += 1;
    finishTtfa(t);
    render();
  });
  player.on("turnreceived", ({ turn }) => {
    const t = con.turns.get(turn);
    if (t) {
      t.ended = true;
      // Normally the worklet says "ended" once the last sample played; never wait forever for it.
      setTimeout(() => turnDone(t), 2000 + (1000 * t.samples) / 24000);
    }
    render();
  });
  player.on("skip", ({ turnId, sentenceSeq }) => setStatus(`skipped sentence ${sentenceSeq} of ${turnId}: this page fell behind`));
  player.on("error", ({ code, message }) => fail(code, message));
  player.on("ready", () => {
    con.state = "ready";
    con.onReady && con.onReady();
  });
  player.on("close", ({ code, reason, reconnect }) => {
    con.state = reconnect ? "connecting" : "closed";
    if (con.onReady && !reconnect) con.onReady(new Error(`the edge closed the connection: ${code} ${reason}`));
    else if (!reconnect && code !== 1000) fail("closed", `connection to the edge closed (${code} ${reason}); reload the page`);
    updateButtons();
  });
  return player;
}

// --- turns and sentences ----------------------------------------------------------------------------
function newTurn(number, turnId) {
  const expected = con.expected.get(turnId) || { mode: "?", play: null };
  return {
    number, turnId, mode: expected.mode, play: expected.play, sentences: new Map(), samples: 0,
    audibleAtUs: null, firstTokenAtUs: null, ttfaMs: null, ended: false, stopped: false, done: false,
    bargedAtUs: null, lateSentences: 0,
  };
}

function sentenceOf(turn, seq) {
  if (!turn.sentences.has(seq)) turn.sentences.set(seq, { seq, timeline: null, samples: 0, audibleAtUs: null });
  return turn.sentences.get(seq);
}

function finishTtfa(turn) {
  if (turn.ttfaMs !== null || !turn.audibleAtUs || !turn.firstTokenAtUs) return;
  turn.ttfaMs = (turn.audibleAtUs - turn.firstTokenAtUs) / 1000;
  const play = con.plays.find((p) => p.play === turn.play && p.mode === turn.mode);
  if (play && play.ttfaMs === null) {
    play.ttfaMs = turn.ttfaMs;
    con.results[play.mode] = turn.ttfaMs;
    renderResults();
  }
}

function turnDone(turn) {
  if (turn.done) return;
  turn.done = true;
  con.current = null;
  render();
  checkPlays();
}

function checkPlays() {
  for (const play of con.plays) {
    if (play.done) continue;
    const turns = play.turnIds.map((id) => con.turns.get(con.turnIds.get(id)));
    const finished = play.turnIds.every((id, i) => {
      if (turns[i] && turns[i].done) return true;
      // A turn the recording itself cancels (a recorded barge-in) may never reach this page.
      return play.cancelledIds.has(id) && turns.slice(i + 1).some((t) => t && t.done);
    });
    if (finished || play.barged) {
      play.done = true;
      play.resolve();
    }
  }
}

// Audio starts on the first click (browsers start audio only after a user gesture); resolves on the
// edge's ready.
async function ensureConnected() {
  if (con.state === "ready") return;
  if (con.state === "closed" && con.player) {
    con.player.close(); // it gave up (the edge refused it): a new one
    con.player = null;
  }
  setStatus("connecting…");
  const ready = new Promise((resolve, reject) => {
    con.onReady = (err) => {
      con.onReady = null;
      if (err) reject(err);
      else resolve();
    };
  });
  if (!con.player) await newPlayer().start();
  await ready;
}

// --- actions -----------------------------------------------------------------------------------------
function selectedMode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function answerRequest() {
  const source = $("source").value;
  if (source === "@typed") return { text: $("text").value, language: $("language").value };
  return { conversation: source };
}

async function playOnce(mode) {
  const answer = await api("play", { mode, ...answerRequest() });
  const play = {
    mode, play: answer.play, turnIds: answer.turns.map((t) => t.turn_id), ttfaMs: null, done: false, barged: false,
    cancelledIds: new Set(answer.turns.filter((t) => t.cancelled_at_ms !== null).map((t) => t.turn_id)),
  };
  for (const id of play.turnIds) con.expected.set(id, { mode, play: answer.play });
  for (const turn of con.turns.values()) {
    if (con.expected.has(turn.turnId) && turn.mode === "?") Object.assign(turn, con.expected.get(turn.turnId));
  }
  const finished = new Promise((resolve) => (play.resolve = resolve));
  con.plays.push(play);
  showSpoken(answer.turns);
  setStatus(`playing ${answer.turns.length > 1 ? `${answer.turns.length} turns` : "the answer"}, ${mode} hand-off`);
  const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error(`no end of the ${mode} answer within ${PLAY_TIMEOUT_MS / 1000} s`)), PLAY_TIMEOUT_MS));
  await Promise.race([finished, timeout]);
  return play;
}

async function run(action) {
  if (con.busy) return;
  con.busy = true;
  updateButtons();
  try {
    await ensureConnected();
    await action();
  } catch (err) {
    fail("console", String(err.message || err));
  } finally {
    con.busy = false;
    updateButtons();
  }
}

async function play() {
  const mode = selectedMode();
  con.results[mode] = null;
  renderResults();
  const p = await playOnce(mode);
  setStatus(p.barged ? "barged in: the rest of the answer was dropped" : `done (${mode})`);
}

async function compare() {
  con.results = { buffered: null, incremental: null };
  renderResults();
  const b = await playOnce("buffered");
  if (b.barged) return setStatus("barged in: compare stopped");
  const i = await playOnce("incremental");
  setStatus(i.barged ? "barged in: compare stopped" : "compared: same answer, same model, only the hand-off differs");
}

async function bargeIn() {
  const play = con.plays.find((p) => !p.done);
  const cur = con.current && con.turns.get(con.current.turn);
  const turn = cur || (play && [...play.turnIds].reverse().map((id) => con.turns.get(con.turnIds.get(id))).find((t) => t && !t.done));
  const nowUs = Math.round(con.clock.serverNowUs());
  if (turn) turn.bargedAtUs = nowUs;
  // silent now, here; the edge stops the turn (or, none known yet, every turn of the session)
  con.player.cancel(turn ? turn.turnId : undefined);
  if (play) {
    play.barged = true;
    play.bargedAtUs = nowUs;
  }
  try {
    await api("stop"); // the agent stops talking, as an interrupted agent does
  } catch (err) {
    fail("stop", String(err.message || err));
  }
  markDropped(nowUs);
  checkPlays();
  render();
}

// --- views -------------------------------------------------------------------------------------------
let spokenTimer = null;
let spokenTokens = [];
let spokenStart = 0;

function showSpoken(turns) {
  clearInterval(spokenTimer);
  spokenTokens = turns.flatMap((t) => t.tokens.map(([ms, text]) => ({ ms, text, turn: t.turn_id })));
  spokenStart = performance.now();
  const box = $("spoken");
  box.innerHTML = "";
  for (const token of spokenTokens) {
    token.el = document.createElement("span");
    token.el.textContent = token.text;
    token.el.className = "pending";
    box.appendChild(token.el);
  }
  const tick = () => {
    const elapsed = performance.now() - spokenStart;
    let left = 0;
    for (const token of spokenTokens) {
      if (token.el.className === "pending" && token.ms <= elapsed) token.el.className = "";
      if (token.el.className === "pending") left += 1;
    }
    if (!left) clearInterval(spokenTimer);
  };
  spokenTimer = setInterval(tick, 50);
}

function markDropped() {
  // What the agent had not said yet when the page barged in is never said: the agent stopped.
  clearInterval(spokenTimer);
  for (const token of spokenTokens) if (token.el.className === "pending") token.el.className = "dropped";
}

const drawWave = waveView($("wave"));

function renderResults() {
  const values = [con.results.buffered, con.results.incremental];
  const max = Math.max(...values.filter((v) => v !== null), 1);
  for (const mode of ["buffered", "incremental"]) {
    const v = con.results[mode];
    $(`ttfa-${mode}`).textContent = v === null ? "–" : `${Math.round(v)} ms`;
    $(`bar-${mode}`).style.width = v === null ? "0" : `${(100 * v) / max}%`;
  }
  const [b, i] = values;
  $("ratio").textContent = b !== null && i !== null ? `buffered waits ${(b / i).toFixed(2)}× as long (${Math.round(b - i)} ms more)` : "";
}

let renderQueued = false;
function render() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    renderTurns();
  });
}

function renderTurns() {
  const box = $("turns");
  box.innerHTML = "";
  const numbers = [...con.turns.keys()].sort((a, b) => b - a); // newest first
  for (const number of numbers) box.appendChild(turnView(con.turns.get(number)));
}

function ms(value, base) {
  return value && base ? ((value - base) / 1000).toFixed(0) : "";
}

function turnView(turn) {
  const section = document.createElement("div");
  section.className = `turn ${turn.mode}`;
  section.dataset.turnId = turn.turnId;
  section.dataset.mode = turn.mode;
  const h = document.createElement("h3");
  const tag = document.createElement("span");
  tag.className = "mode";
  tag.textContent = turn.mode;
  h.append(tag, ` ${turn.turnId}`, turn.ttfaMs !== null ? ` · first audible sound ${Math.round(turn.ttfaMs)} ms after the first token` : "");
  section.appendChild(h);
  if (turn.mode === "buffered") {
    const n = document.createElement("div");
    n.className = "note ok";
    n.textContent = "buffered: the gate hands the whole answer to synthesis at the end of the turn (one request)";
    section.appendChild(n);
  }
  if (turn.bargedAtUs) {
    const synthesized = [...turn.sentences.values()].filter((s) => s.timeline && s.samples > 0).length;
    const n = document.createElement("div");
    n.className = turn.lateSentences ? "note" : "note ok";
    n.textContent = turn.lateSentences
      ? `barged in, but ${turn.lateSentences} sentence(s) were synthesized after it`
      : `barged in at ${ms(turn.bargedAtUs, turn.firstTokenAtUs)} ms: ${synthesized} sentence(s) synthesized; the rest of the answer never was (no row after the barge-in)`;
    section.appendChild(n);
  }
  const table = document.createElement("table");
  table.className = "waterfall";
  table.innerHTML = "<thead><tr><th>sentence</th><th>tokens done</th><th>released</th><th>synth start</th><th>first chunk</th><th>sent</th><th>audible</th><th>audio s</th><th></th></tr></thead>";
  const body = document.createElement("tbody");
  const base = turn.firstTokenAtUs;
  const sentences = [...turn.sentences.values()].filter((s) => s.timeline).sort((a, b) => a.seq - b.seq);
  let end = 1;
  for (const s of sentences) {
    const stamps = [...SEGMENTS.map(([f]) => (f === "audibleAtUs" ? s.audibleAtUs : s.timeline[f]))].filter(Boolean);
    if (stamps.length && base) end = Math.max(end, Math.max(...stamps) - base);
  }
  for (const s of sentences) {
    const t = s.timeline;
    const row = document.createElement("tr");
    const empty = s.samples === 0 && turn.ended;
    row.className = empty ? "end" : "sentence";
    if (turn.bargedAtUs && t.synthesis_started_at_us > turn.bargedAtUs + 20000) row.className += " late";
    if (con.current && con.current.turn === turn.number && con.current.sentence === s.seq) row.className += " playing";
    row.dataset.sentence = s.seq;
    const cells = [empty ? `${s.seq} (end of turn)` : `${s.seq}`];
    for (const [field] of SEGMENTS) cells.push(ms(field === "audibleAtUs" ? s.audibleAtUs : t[field], base));
    cells.push(s.samples ? (s.samples / 24000).toFixed(1) : "");
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      row.appendChild(td);
    }
    const track = document.createElement("td");
    track.className = "track";
    let from = t.first_token_at_us || base;
    for (const [field, colour] of SEGMENTS) {
      const to = field === "audibleAtUs" ? s.audibleAtUs : t[field];
      if (!to || !from || !base) continue;
      const bar = document.createElement("div");
      bar.style.left = `${(100 * (from - base)) / end}%`;
      bar.style.width = `${Math.max(0.3, (100 * (to - from)) / end)}%`;
      bar.style.background = colour;
      track.appendChild(bar);
      from = to;
    }
    if (s.audibleAtUs && base) {
      const mark = document.createElement("div");
      mark.className = "audible";
      mark.style.left = `${(100 * (s.audibleAtUs - base)) / end}%`;
      track.appendChild(mark);
    }
    row.appendChild(track);
    body.appendChild(row);
  }
  table.appendChild(body);
  section.appendChild(table);
  return section;
}

function updateButtons() {
  const ready = !!con.session;
  $("play").disabled = !ready || con.busy;
  $("compare").disabled = !ready || con.busy;
  $("bargein").disabled = !con.busy;
}

async function init() {
  if (!key) {
    setStatus("no console key in this URL: open the URL `voicebus demo` printed (it ends with #k=...)", true);
    return;
  }
  try {
    const session = await api("session");
    Object.assign(con, { session: session.session, token: session.token, conversations: session.conversations });
    for (const c of session.conversations) {
      const option = document.createElement("option");
      option.value = c.name;
      option.textContent = `${c.name}: ${c.title}`;
      $("source").appendChild(option);
    }
    const typed = document.createElement("option");
    typed.value = "@typed";
    typed.textContent = "type a text…";
    $("source").appendChild(typed);
    for (const language of session.languages) {
      const option = document.createElement("option");
      option.value = option.textContent = language;
      $("language").appendChild(option);
    }
    $("language").value = session.languages.includes("en") ? "en" : session.languages[0];
    con.state = "idle";
    setStatus(`session ${con.session}: pick an answer and press Play or Compare (audio starts on your click)`);
  } catch (err) {
    fail("console", String(err.message || err));
  }
  updateButtons();
}

$("source").onchange = () => $("typed-row").classList.toggle("on", $("source").value === "@typed");
$("play").onclick = () => run(play);
$("compare").onclick = () => run(compare);
$("bargein").onclick = bargeIn;
init();
