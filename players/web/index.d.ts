// Types of @voicebus/player (index.js), written by hand. The protocol's constants and their types
// (protocol.d.ts) are generated from the Python side: players/protocol.py.

export * from "./protocol.js";

/** How to reach a session: `createPlayer`'s options. */
export interface PlayerOptions {
  /** The session to play. */
  session: string;
  /** The edge's token for that session (`voicebus token --session S`, or your backend's
   *  `voicebus.players.auth.issue_token`). It travels only inside the WebSocket `hello`. */
  token: string;
  /** The edge's WebSocket endpoint, e.g. `"wss://edge.example.com/ws"`; `http(s)` URLs are taken
   *  as `ws(s)`, a path (`"/ws"`, the default) is on the page's origin. */
  edgeUrl?: string | URL;
  /** Edge origins besides `edgeUrl`'s own that a redirect, or the edge list of `ready`, may send
   *  the player to (`"https://edge-2.example.com"`): an array, or one comma-separated string.
   *  Any other is refused (the `redirect` event says so): the token never goes elsewhere. */
  allowedOrigins?: readonly string[] | string;
  /** Where the AudioWorklet module is: by default `worklet.js` beside `index.js`
   *  (`new URL("./worklet.js", import.meta.url)`); set it when a bundler moves the files. */
  workletUrl?: string | URL;
  /** Audio buffered before each (re)start of playback, in ms (default 60). */
  jitterMs?: number;
  /** Reconnect, with `resume`, when the connection is lost or the session moves (default true).
   *  Redirects are followed either way. */
  reconnect?: boolean;
}

/** A caption's word: its text as the agent wrote it, its start and end in samples from the start
 *  of its sentence's audio. */
export interface Word {
  text: string;
  start: number;
  end: number;
}

/** How far a turn was rendered: the furthest sentence and the samples rendered of it. */
export interface Rendered {
  sentenceSeq: number;
  samples: number;
}

/** Which turn an event is about: the player's number for it (one per turn id, across edges) and
 *  the turn's id. */
export interface TurnRef {
  turn: number;
  turnId: string;
}

/** The edge's `timeline` message: when each stage handled a sentence (epoch µs, server clock). */
export interface Timeline {
  type: "timeline";
  v: number;
  turn_id: string;
  turn: number;
  sentence_seq: number;
  first_token_at_us: number;
  text_complete_at_us: number;
  released_at_us: number;
  request_received_at_us: number;
  synthesis_started_at_us: number;
  audio_ready_at_us: number;
  published_at_us: number;
  edge_received_at_us: number;
  sent_at_us: number;
}

/** What the AudioWorklet counts (the `wave` event carries it). */
export interface PlaybackStats {
  /** The last render quantum's peak, 0..1. */
  peak: number;
  stops: number;
  underruns: number;
  /** Render quanta since the last stop, and how many of them were not silent. */
  quantaSinceStop: number;
  loudQuantaSinceStop: number;
}

/** Why the player reconnects, and where to. */
export interface Reconnect {
  url: string;
  delayMs: number;
  /** `redirect`: the edge does not own the session; `moved`: a rebalance moved it; `busy`: the
   *  edge is full (1013); `lost`: the edge is gone (1006, 1001), the next known edge is tried. */
  why: "redirect" | "moved" | "busy" | "lost";
}

/** Every event and what its listeners get. */
export interface PlayerEvents {
  /** The edge accepted the hello: audio follows. After every (re)connection. */
  ready: { session: string; clientId: string; edge: string | null; url: string };
  /** A new turn: its audio follows. */
  turnstart: TurnRef & { sampleRate: number };
  /** A sentence's first audio was sent, with when each stage handled it. */
  timeline: TurnRef & { sentenceSeq: number; timeline: Timeline };
  /** Words of a sentence arrived (before the audio that speaks them): all of that sentence's
   *  words known so far, in order. */
  words: TurnRef & { sentenceSeq: number; words: Word[] };
  /** The word being heard changed: `words[index]`, the last word whose start was rendered. */
  caption: TurnRef & { sentenceSeq: number; words: Word[]; index: number; word: Word; samples: number; frame: number };
  /** The player started to play a sentence. */
  playing: TurnRef & { sentenceSeq: number };
  /** Audio went to the worklet: `samples` samples of a sentence. */
  audio: TurnRef & { sentenceSeq: number; samples: number };
  /** A sentence's first non-silent sample was rendered (`atUs`: server clock, epoch µs). */
  sentenceaudible: TurnRef & { sentenceSeq: number; atUs: number };
  /** The turn's first non-silent sample was rendered (reported to the edge as AUDIBLE_START). */
  audible: TurnRef & { sentenceSeq: number; atUs: number };
  /** The edge sent the turn's last audio (its `turn_end`); `reason` when it ended without all
   *  its audio. Playing it out ends with `turnend`. */
  turnreceived: TurnRef & { reason: string | null };
  /** The turn is over here: played to its end, or `stopped` (a `cancel()`, or the edge's `stop`:
   *  another player's barge-in, a preempting turn). `rendered`: how far it was heard (sent to the
   *  edge, which publishes what the listener heard). Once per turn. */
  turnend: TurnRef & { stopped: boolean; reason: string | null; atUs: number; rendered: Rendered | null };
  /** Playback ran dry before the turn's end (reported as UNDERRUN). */
  underrun: TurnRef & { sentenceSeq: number; atUs: number };
  /** This player fell behind; the edge dropped a sentence for it. */
  skip: { turnId: string; sentenceSeq: number };
  /** The edge sent a redirect; `followed` is false when its origin is not allowed. */
  redirect: { url: string; followed: boolean };
  /** A rebalance moved the session to another edge; a close and a reconnect follow. */
  moved: { reason: string };
  /** The connection closed; `reconnect` says where the player goes next (null: nowhere). */
  close: { code: number; reason: string; url: string | null; reconnect: Reconnect | null };
  /** An error: the edge's (`code` as in docs/protocol.md, e.g. `expired-token`, `rate-limited`)
   *  or the player's own (`audio`: the AudioContext or worklet could not start; `opus`). */
  error: { code: string; message: string };
  /** Every ~21 ms (4 render quanta): the rendered audio as (min, max) pairs, one per quantum, for
   *  a live waveform (`waveView`), and the worklet's counters. */
  wave: { wave: number[]; stats: PlaybackStats };
}

export type PlayerEventType = keyof PlayerEvents;
export type PlayerState = "idle" | "connecting" | "ready" | "closed";

/** A turn as the player keeps it. */
export interface PlayerTurn {
  turnId: string;
  /** The `timeline` of its first sentence (empty until it came). */
  timeline: Partial<Timeline>;
  /** When its first non-silent sample was rendered (server clock, epoch µs). */
  audibleAtUs: number | null;
  /** Its words, by sentence. */
  words: Map<number, Word[]>;
}

/** The edge's clock as seen from the page (ping/pong, NTP-like). */
export declare class EdgeClock {
  offsetUs: number;
  rttUs: number;
  samples: number;
  onReady(serverTimeUs: number): void;
  onPong(msg: { t0: number; server_time_us: number }, nowMs?: number): void;
  /** Now, on the edge's clock (epoch µs). */
  serverNowUs(): number;
  /** A context time (s) of a rendered sample, on the edge's clock (epoch µs). */
  contextTimeToServerUs(ctx: AudioContext, contextTime: number): number;
}

/** A player of one session. Create it with `createPlayer`. */
export declare class Player {
  constructor(options: PlayerOptions);
  readonly session: string;
  /** `idle` until `start()`, `connecting`, `ready` (audio flows), `closed` (between connections
   *  too, and after `close()`). */
  readonly state: PlayerState;
  readonly clientId: string | null;
  /** The id of the edge connected to (edges with Kafka), else null. */
  readonly edge: string | null;
  readonly clock: EdgeClock;
  /** The turns, by the player's number for them. */
  readonly turns: ReadonlyMap<number, PlayerTurn>;
  /** The turn and sentence being played, if any. */
  readonly current: { turn: number; sentence: number } | null;
  readonly stats: Partial<PlaybackStats>;
  readonly errors: ReadonlyArray<{ code: string; message: string }>;
  /** The AudioContext (24 kHz) once started. */
  readonly ctx: AudioContext | null;
  /** Listen to an event; returns a function that removes the listener. */
  on<K extends PlayerEventType>(type: K, listener: (event: PlayerEvents[K]) => void): () => void;
  off<K extends PlayerEventType>(type: K, listener: (event: PlayerEvents[K]) => void): void;
  /** Starts the audio and connects. Call it from a user gesture (a click): browsers start audio
   *  only then. Rejects when audio cannot start. */
  start(): Promise<void>;
  /** Barge-in: silences the turn now and asks the edge to cancel it (`turnId`, else the turn
   *  being played, else every turn of the session). Returns the turn id cancelled, or null. */
  cancel(turnId?: string): string | null;
  /** Closes the connection and the audio; no reconnect. */
  close(): void;
}

/** A player for `options.session` at `options.edgeUrl`; call `start()` from a click. */
export declare function createPlayer(options: PlayerOptions): Player;

/** The jitter buffer's default, in ms. */
export declare const JITTER_MS: number;

/** An audio frame's header (docs/protocol.md, "Audio frames"), or null for another frame type
 *  or protocol version. */
export declare function parseAudioFrame(buffer: ArrayBuffer): {
  view: DataView;
  flags: number;
  encoding: number;
  turn: number;
  sentence: number;
  chunk: number;
  sampleRate: number;
} | null;

/** A PCM16LE audio frame's samples as floats in [-1, 1). */
export declare function pcm16Samples(buffer: ArrayBuffer): Float32Array;

/** A live waveform on a canvas: returns the function to pass each `wave` event's `wave`. */
export declare function waveView(canvas: HTMLCanvasElement): (wave: number[]) => void;

/** The origin of an absolute http(s)/ws(s) URL, ws written as http ("http://edge-2:8765"); "" otherwise. */
export declare function edgeOrigin(url: string | URL): string;

/** A comma-separated list of origins, normalized as `edgeOrigin` writes them. */
export declare function parseOrigins(list: string | null | undefined): string[];

/** Whether an absolute edge URL may be followed from `fromUrl`: the same origin, or an allowed one. */
export declare function edgeAllowed(url: string, fromUrl: string, allowedOrigins: readonly string[]): boolean;
