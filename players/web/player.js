// voicebus web player: the page the edge serves at `/`, built on the player module (index.js, the
// npm package @voicebus/player): a Start and a Barge-in button, the status line, live captions
// (the word being rendered highlighted), the live waveform and each turn's timeline. No build
// step, no dependencies.

import { createPlayer, parseOrigins, waveView } from "./index.js";

const $ = (id) => document.getElementById(id);
// The page URL is /#session=S&token=T: a fragment never reaches a server (no access log, proxy or
// Referer sees the token). The token goes to the edge only inside the WebSocket hello.
const fragment = new URLSearchParams(location.hash.slice(1));
const query = new URLSearchParams(location.search);
$("session").value = fragment.get("session") || query.get("session") || "";
$("token").value = fragment.get("token") || "";
const tokenInQuery = query.has("token");

// Everything the page knows, exposed for debugging and for the end-to-end test: the player itself
// (state, clock, turns, edges, reports, errors, stats, ...) once Start is pressed, plus the page's
// own records.
const page = {
  state: "idle",
  captions: [], // every word highlighted: {turn, sentence, index, text, lagMs, postedMs, deliveryMs, shownAtMs} (lag behind its rendered start)
  bargeIns: [], // server-clock µs of each barge-in click
  errors: [],
};
window.voicebusPlayer = page;
let player = null;

function setStatus(text) {
  $("status").textContent = text;
}

if (tokenInQuery && !fragment.get("token")) {
  // An old-style link (?token=...): that token was already sent to the server and may be logged.
  setStatus("the token in this URL's query (?token=) is not used: it reaches server logs. " +
    "Open the player with #session=S&token=T (voicebus token prints that URL) or paste the token above.");
}

function newPlayer() {
  const p = createPlayer({
    session: $("session").value,
    token: $("token").value,
    // edgeUrl: this page's own edge (/ws); the edge writes the other origins it may send the page to
    allowedOrigins: parseOrigins(document.documentElement.dataset.edgeOrigins),
  });
  p.captions = page.captions;
  p.bargeIns = page.bargeIns;
  p.errors = page.errors;
  window.voicebusPlayer = p;
  p.on("ready", ({ session, clientId }) => {
    setStatus(`connected as ${clientId} to session ${session}`);
    $("bargein").disabled = false;
  });
  p.on("close", ({ code, reason, reconnect }) => {
    $("bargein").disabled = true;
    if (reconnect && reconnect.why === "redirect") setStatus(`redirected to ${reconnect.url}`);
    else if (reconnect && reconnect.why === "moved") setStatus("session moved to another edge; reconnecting");
    else if (reconnect && reconnect.why === "busy") setStatus(`edge busy (${reason}); retrying`);
    else if (reconnect) setStatus(`connection lost (${code}); reconnecting`);
    else if (code !== 1000 && !p.redirectRefused) setStatus(`closed ${code} ${reason}`);
  });
  p.on("redirect", ({ url, followed }) => {
    if (!followed) {
      setStatus(`redirect to ${url || "(no URL)"} refused: not this page's origin nor one it allows ` +
        "(data-edge-origins); not followed");
    }
  });
  p.on("moved", ({ reason }) => setStatus(`session moved (${reason}): reconnecting`));
  p.on("skip", ({ turnId, sentenceSeq }) => setStatus(`skipped sentence ${sentenceSeq} of ${turnId}: this player fell behind`));
  p.on("error", ({ code, message }) => setStatus(code === "opus" ? message : `error ${code}: ${message}`));
  p.on("wave", ({ wave }) => drawWave(wave));
  p.on("caption", showCaption);
  for (const type of ["turnstart", "timeline", "audible"]) p.on(type, renderTimeline);
  return p;
}

// --- live captions: the word whose start the worklet rendered last ---------------------------
function showCaption({ turnId, sentenceSeq, words, index, samples, frame }) {
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
  const ctx = player.ctx;
  const msPerFrame = 1000 / ctx.sampleRate;
  const renderedFrame = ctx.currentTime * ctx.sampleRate;
  const startFrame = frame - (samples - words[index].start);
  const lagMs = (renderedFrame - startFrame) * msPerFrame;
  const deliveryMs = (renderedFrame - frame) * msPerFrame;
  page.captions.push({ turn: turnId, sentence: sentenceSeq, index, text: words[index].text, lagMs, postedMs: lagMs - deliveryMs, deliveryMs, shownAtMs: performance.now() });
  if (page.captions.length > 1000) page.captions.shift();
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
  try {
    player = newPlayer();
  } catch (err) {
    return setStatus(`${err.message}: fill in the session and its token`);
  }
  $("start").disabled = true;
  try {
    setStatus("connecting");
    await player.start();
  } catch (err) {
    setStatus(`audio failed: ${err}`);
    $("start").disabled = false;
  }
};

$("bargein").onclick = () => {
  page.bargeIns.push(Math.round(player.clock.serverNowUs()));
  player.cancel(); // silent now, here; the edge stops the turn everywhere
};
