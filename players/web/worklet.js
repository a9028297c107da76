// voicebus player worklet: plays queued PCM through a small jitter buffer, stops within one
// render quantum, and reports the frame at which each turn's first non-silent sample is rendered.
// It also tracks how far each turn was rendered (sentence, samples into it): every few quanta
// as "position" (the page's live captions follow it) and with "stopped"/"ended" (the heard
// report the edge turns into TurnHeard).
// Runs on the audio rendering thread: messages from the main thread are handled between render
// quanta, so a "stop" silences the very next quantum.

const AUDIBLE_THRESHOLD = 1 / 1024; // about -60 dBFS
const WAVE_EVERY_QUANTA = 4;
const POSITION_EVERY_QUANTA = 2; // ~11 ms at 24 kHz: captions follow the rendered audio closely

class VoicebusPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = (options && options.processorOptions) || {};
    this.jitterFrames = Math.round(((opts.jitterMs ?? 60) / 1000) * sampleRate);
    this.queue = []; // {turn, sentence, samples, offset}
    this.queuedFrames = 0;
    this.buffering = true; // wait for the jitter buffer before (re)starting
    this.endedTurns = new Set(); // the server said turn_end: play out whatever is left
    this.stoppedTurns = new Set();
    this.audibleTurns = new Set();
    this.audibleSentences = new Set(); // "turn:sentence" whose first non-silent sample was rendered
    this.currentTurn = null;
    this.currentSentence = -1;
    this.stats = { quantaSinceStop: 0, loudQuantaSinceStop: 0, stops: 0, underruns: 0, peak: 0 };
    this.stopPending = false;
    this.wave = [];
    this.queuedPerSentence = new Map(); // "turn:sentence" -> samples queued so far (a chunk's base)
    this.rendered = new Map(); // turn -> {sentence, samples}: the furthest point rendered
    this.quanta = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(msg) {
    if (msg.type === "chunk") {
      if (this.stoppedTurns.has(msg.turn)) return;
      const key = `${msg.turn}:${msg.sentence}`;
      const base = this.queuedPerSentence.get(key) || 0;
      this.queuedPerSentence.set(key, base + msg.samples.length);
      if (this.queuedPerSentence.size > 4096) this.queuedPerSentence.clear();
      this.queue.push({ turn: msg.turn, sentence: msg.sentence, samples: msg.samples, offset: 0, base });
      this.queuedFrames += msg.samples.length;
    } else if (msg.type === "end") {
      this.endedTurns.add(msg.turn);
    } else if (msg.type === "stop") {
      // Drop everything of the turn (all turns when none is named): the next quantum is silent.
      const keep = [];
      for (const item of this.queue) {
        if (msg.turn == null || item.turn === msg.turn) this.stoppedTurns.add(item.turn);
        else keep.push(item);
      }
      if (msg.turn != null) this.stoppedTurns.add(msg.turn);
      this.queue = keep;
      this.queuedFrames = keep.reduce((n, it) => n + it.samples.length - it.offset, 0);
      this.stats.stops += 1;
      this.stats.quantaSinceStop = 0;
      this.stats.loudQuantaSinceStop = 0;
      this.stats.stopFrame = currentFrame;
      this.stopPending = true;
      const turn = msg.turn != null ? msg.turn : this.currentTurn;
      this.port.postMessage({ type: "stopped", turn, frame: currentFrame, rendered: this.renderedOf(turn) });
    }
  }

  renderedOf(turn) {
    return this.rendered.get(turn) || { sentence: 0, samples: 0 };
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    out.fill(0);
    const head = this.queue[0];
    if (this.buffering && head) {
      const turnEnded = this.endedTurns.has(head.turn);
      if (this.queuedFrames >= this.jitterFrames || turnEnded) this.buffering = false;
    }
    let i = 0;
    while (!this.buffering && i < out.length && this.queue.length) {
      const item = this.queue[0];
      if (item.turn !== this.currentTurn || item.sentence !== this.currentSentence) {
        this.currentTurn = item.turn;
        this.currentSentence = item.sentence;
        this.port.postMessage({ type: "playing", turn: item.turn, sentence: item.sentence, frame: currentFrame + i });
      }
      const n = Math.min(out.length - i, item.samples.length - item.offset);
      if (item.watch === undefined) {
        // Checked once per chunk, not per sample: does this chunk's sentence still wait for its first sound?
        item.key = `${item.turn}:${item.sentence}`;
        item.watch = !this.audibleSentences.has(item.key);
      }
      for (let k = 0; k < n; k++) {
        const v = item.samples[item.offset + k];
        out[i + k] = v;
        if (item.watch && Math.abs(v) > AUDIBLE_THRESHOLD) {
          item.watch = false;
          const frame = currentFrame + i + k;
          if (this.audibleSentences.size > 4096) this.audibleSentences.clear();
          this.audibleSentences.add(item.key);
          this.port.postMessage({ type: "sentence_audible", turn: item.turn, sentence: item.sentence, frame, time: frame / sampleRate });
          if (!this.audibleTurns.has(item.turn)) {
            this.audibleTurns.add(item.turn);
            this.port.postMessage({ type: "audible", turn: item.turn, sentence: item.sentence, frame, time: frame / sampleRate });
          }
        }
      }
      item.offset += n;
      i += n;
      this.queuedFrames -= n;
      const pos = { sentence: item.sentence, samples: item.base + item.offset };
      const was = this.rendered.get(item.turn);
      if (!was || pos.sentence > was.sentence || (pos.sentence === was.sentence && pos.samples > was.samples)) {
        this.rendered.set(item.turn, pos);
        if (this.rendered.size > 64) this.rendered.delete(this.rendered.keys().next().value);
      }
      this.position = { turn: item.turn, sentence: item.sentence, samples: pos.samples, frame: currentFrame + i };
      if (item.offset >= item.samples.length) {
        this.queue.shift();
        if (!this.queue.length || this.queue[0].turn !== item.turn) {
          if (this.endedTurns.has(item.turn)) {
            this.port.postMessage({ type: "ended", turn: item.turn, frame: currentFrame + i, rendered: this.renderedOf(item.turn) });
          }
        }
      }
    }
    if (!this.buffering && !this.queue.length && i < out.length && this.currentTurn !== null && !this.endedTurns.has(this.currentTurn) && !this.stoppedTurns.has(this.currentTurn)) {
      this.stats.underruns += 1;
      this.port.postMessage({ type: "underrun", turn: this.currentTurn, sentence: this.currentSentence, frame: currentFrame + i });
      this.buffering = true;
    }
    if (!this.queue.length) this.buffering = true;
    let peak = 0;
    let min = 0, max = 0;
    for (let k = 0; k < out.length; k++) {
      const v = out[k];
      if (v > max) max = v;
      if (v < min) min = v;
    }
    peak = Math.max(max, -min);
    this.stats.peak = peak;
    if (this.stopPending) {
      this.stats.quantaSinceStop += 1;
      if (peak > 0) this.stats.loudQuantaSinceStop += 1; // any sound at all after the stop
    }
    this.quanta += 1;
    if (this.position && this.quanta % POSITION_EVERY_QUANTA === 0) {
      this.port.postMessage({ type: "position", ...this.position });
      this.position = null;
    }
    this.wave.push(min, max);
    if (this.wave.length >= 2 * WAVE_EVERY_QUANTA) {
      this.port.postMessage({ type: "wave", wave: this.wave, stats: this.stats, frame: currentFrame });
      this.wave = [];
    }
    return true;
  }
}

registerProcessor("voicebus-player", VoicebusPlayer);
