// Generated from players/protocol.py by `python -m voicebus.players.protocol --write-js`: do not
// edit. The player protocol's constants (docs/protocol.md), the same on both sides.

export declare const PROTOCOL_VERSION: 1;
export declare const FRAME_AUDIO: 1;
/** <BBBBIIII: type, version, flags, encoding, turn, sentence, chunk, sample rate */
export declare const HEADER_BYTES: 20;
export declare const FLAG_LAST_IN_SENTENCE: 1;
export declare const FLAG_LAST_IN_TURN: 2;
export declare const FLAG_FIRST_IN_SENTENCE: 4;
export declare const ENCODING_PCM16LE: 1;
export declare const ENCODING_OPUS: 2;
export declare const MAX_TEXT_FRAME_BYTES: 16384;
/** message types (the JSON text frames' `type`) */
export declare const MSG: {
  readonly CANCEL: "cancel";
  readonly ERROR: "error";
  readonly HELLO: "hello";
  readonly PING: "ping";
  readonly PONG: "pong";
  readonly READY: "ready";
  readonly RECONNECT: "reconnect";
  readonly REDIRECT: "redirect";
  readonly REPORT: "report";
  readonly SKIP: "skip";
  readonly STOP: "stop";
  readonly TIMELINE: "timeline";
  readonly TURN_END: "turn_end";
  readonly TURN_START: "turn_start";
  readonly WORDS: "words";
};
/** close codes */
export declare const CLOSE: {
  readonly NORMAL: 1000;
  readonly GOING_AWAY: 1001;
  readonly MESSAGE_TOO_BIG: 1009;
  readonly SERVICE_RESTART: 1012;
  readonly TRY_AGAIN_LATER: 1013;
  readonly REDIRECT: 4307;
  readonly PROTOCOL_ERROR: 4400;
  readonly UNAUTHORIZED: 4401;
  readonly FORBIDDEN_ORIGIN: 4403;
  readonly HELLO_TIMEOUT: 4408;
  readonly UNSUPPORTED_VERSION: 4426;
  readonly TOO_SLOW: 4429;
};
/** a report's `kind` (the PlaybackReport schema's enum) */
export declare const REPORT_KIND: {
  readonly AUDIBLE_START: "AUDIBLE_START";
  readonly PLAYBACK_END: "PLAYBACK_END";
  readonly STOPPED: "STOPPED";
  readonly UNDERRUN: "UNDERRUN";
};
/** a control message's `type` */
export type MessageType = (typeof MSG)[keyof typeof MSG];
/** a close code the edge sends */
export type CloseCode = (typeof CLOSE)[keyof typeof CLOSE];
/** a playback report's `kind` */
export type ReportKind = (typeof REPORT_KIND)[keyof typeof REPORT_KIND];
