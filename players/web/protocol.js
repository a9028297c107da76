// Generated from players/protocol.py by `python -m voicebus.players.protocol --write-js`: do not
// edit. The player protocol's constants (docs/protocol.md), the same on both sides.

export const PROTOCOL_VERSION = 1;
export const FRAME_AUDIO = 1;
export const HEADER_BYTES = 20; // <BBBBIIII: type, version, flags, encoding, turn, sentence, chunk, sample rate
export const FLAG_LAST_IN_SENTENCE = 1;
export const FLAG_LAST_IN_TURN = 2;
export const FLAG_FIRST_IN_SENTENCE = 4;
export const ENCODING_PCM16LE = 1;
export const ENCODING_OPUS = 2;
export const MAX_TEXT_FRAME_BYTES = 16384;
// message types (the JSON text frames' `type`)
export const MSG = Object.freeze({
  CANCEL: "cancel",
  ERROR: "error",
  HELLO: "hello",
  PING: "ping",
  PONG: "pong",
  READY: "ready",
  RECONNECT: "reconnect",
  REDIRECT: "redirect",
  REPORT: "report",
  SKIP: "skip",
  STOP: "stop",
  TIMELINE: "timeline",
  TURN_END: "turn_end",
  TURN_START: "turn_start",
  WORDS: "words",
});
// close codes
export const CLOSE = Object.freeze({
  NORMAL: 1000,
  GOING_AWAY: 1001,
  MESSAGE_TOO_BIG: 1009,
  SERVICE_RESTART: 1012,
  TRY_AGAIN_LATER: 1013,
  REDIRECT: 4307,
  PROTOCOL_ERROR: 4400,
  UNAUTHORIZED: 4401,
  FORBIDDEN_ORIGIN: 4403,
  HELLO_TIMEOUT: 4408,
  UNSUPPORTED_VERSION: 4426,
  TOO_SLOW: 4429,
});
// a report's `kind` (the PlaybackReport schema's enum)
export const REPORT_KIND = Object.freeze({
  AUDIBLE_START: "AUDIBLE_START",
  PLAYBACK_END: "PLAYBACK_END",
  STOPPED: "STOPPED",
  UNDERRUN: "UNDERRUN",
});
