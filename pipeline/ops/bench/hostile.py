"""`voicebus bench hostile`: hostile and careless input against a live stack, beside normal sessions.

A gate, a synthesis worker (the tiny random-weight Kokoro model, seeded: its audio is a function
of the text) and an edge run as their own processes (`voicebus.ops.bench.stages`), on a broker of
their own topics (the one at ``VOICEBUS_BOOTSTRAP`` when it answers, else a throwaway one started
and stopped by the run; given ``--bootstrap``, that one, and none started). The benchmark:

1. **clean run**: the normal sessions replay their turns (LLM-like tokens through the SDK, a
   `voicebus.players.listener.Listener` per session) with nothing else on the bus; each turn's audio is
   hashed per sentence (SHA-256 of the PCM16 the player received, sentence by sentence).
2. **hostile rounds**: the same turns again (fresh session ids, so no state carries over) while
   a hostile agent publishes garbage and edge cases to its own text topic and to the shared
   control, synthesis and audio topics, and hostile clients send malformed frames, oversized
   frames, bad tokens, cancel floods and connection floods, and read slowly or not at all. The
   hostile records target hostile sessions, or carry a normal session's key without being
   decodable (so they land on the same partitions as the normal turns): a valid record that
   names a normal session is that session's own business (who may write a topic is Kafka's ACLs'
   job), except for the one thing the contract promises about it: a whole-session cancel from the
   far future, sent before the session's turns, must mute none of them.
3. A normal turn is **affected** when it did not end, ended with a reason (missing audio), or any
   sentence's hash differs from the clean run's. A stage process that exited counts in
   ``processes_died``. ``memory_growth_mb`` is each stage's resident memory (VmRSS) after the
   last round minus after the first hostile round (which sets the high-water marks: the largest
   forward pass, the first use of each error path); with one round, minus after the clean run.

Settings of the run (`bench_settings`): topics, edge port and secret of its own, PCM16 audio (what
the hashes compare), and the gate's segmenter bound at 256 characters instead of 2048, so a run-on
turn crosses it at a cost the tiny model can pay on a CPU, the edge's players at 64 and the
gate's sessions at 200 (the cases that fill them). ``--parts`` picks the hostile parts
(records, clients, slow-readers, far-future); ``--control`` runs none (the comparison itself must
then find 0 affected turns).

4. **cases** (`voicebus.ops.bench.hostile_cases`), after the rounds: one named attack at a time
   beside the normal sessions (fresh session ids again), each scored on its own: processes died,
   normal turns affected, memory growth per stage (what the attack added: the memory after the
   case less the higher of the levels before and after a control replay without attack just
   before it, after one warm-up replay before the first case; `hostile_cases.attack_only`), and
   whether
   the rejection was reported, with the observable that reported it (a dead-letter reason
   header, a counter on a stage's ``/metrics``, a close code or error frame to the client).
   ``--cases a,b`` picks them (default all; ``none``: the rounds only, as before the cases
   existed); ``--rounds 0`` runs the cases alone after the clean run. ``--control`` runs no case.
   For the cases the bench's edge serves at most 64 players (``pre-hello-flood`` fills that), the
   gate holds at most `GATE_MAX_SESSIONS` sessions (``session-flood`` goes past it), and,
   when ``unknown-schema-flood`` runs, the stages are given a schema registry of the bench's own
   that knows no id and counts the lookups (`hostile_cases.CountingRegistry`).

JSON (``--json PATH``): ``inputs`` (kind -> count), ``processes_died``, ``normal_turns``,
``normal_turns_affected``, ``memory_growth_mb`` (stage -> MB), and ``memory_per_round_mb`` (stage
-> the median round-to-round change, `memory_per_round`: a leak shows there, a high-water step
does not) with ``rss_mb`` (stage -> MB after the clean run and each round), all of the rounds
(``processes_died``: by the end of the run, cases included); and ``cases`` (name -> ``attack``,
``inputs``, ``processes_died``, ``normal_turns``, ``normal_turns_affected``, ``memory_growth_mb``
(attack-only), ``memory_growth_raw_mb``, ``memory_control_mb``, ``control_turns_affected``,
``rejection_reported``, ``reason``, ``detail``) with ``cases_warm_up`` (the warm-up replay's
growth). Figures and reproduction in docs/benchmarks.md
("bench hostile").

Size: about 730 lines: one benchmark (its stage processes, normal sessions, attack rounds and
scoring); its named cases are `voicebus.ops.bench.hostile_cases`, its faults
`voicebus.ops.bench.hostile_faults`. Benchmarks are not on the runtime path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import logging
import random
import secrets
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from voicebus.cli import add_json_argument
from voicebus.ops.bench.cli import add_stage_log_level
from voicebus.ops.bench.hostile_cases import (CASES, MEMORY_TARGET_MB, CaseContext, CountingRegistry, Helpers,
                                              case_ok, format_cases, memory_ok, parse_cases, run_cases)
from voicebus.schemas.contract import AudioEncoding, TextEventKind
from voicebus.schemas.messages import AudioChunk, SynthesisRequest, TextEvent, WordTiming
from voicebus.settings import Settings

log = logging.getLogger(__name__)

NORMAL_TEXTS = (
    "The weather today is mild, with a light breeze from the west. Expect clear skies by the evening.",
    "Your train leaves at nine. Platform four is on the left, right after the stairs.",
    "Here is a short answer. It has three sentences. This one is the last.",
)
HOSTILE_AGENT = "hostile"
PARTS = ("records", "clients", "slow-readers", "far-future")
NORMAL_AGENT = "assistant"
EDGE_MAX_CLIENTS = 64  # the bench's edge: players at once (sockets before their hello included)
GATE_MAX_SESSIONS = 200  # the bench's gate: sessions held at once (the session-flood case goes past it)
TURN_TIMEOUT_S = 300.0  # a normal turn waits behind hostile synthesis on a loaded 2-core machine


@dataclass
class Plan:
    sessions: int = 2  # normal sessions, concurrently
    turns: int = 2  # turns per normal session, one after the other
    rounds: int = 1  # hostile rounds after the clean run
    scale: int = 1  # multiplies the count of each hostile input
    token_ms: float = 15.0
    # the cases' memory method: warm-up replays, then a control replay before each case. Off (a
    # test of what the cases observe, not of their memory), each case's growth is its raw growth.
    memory: bool = True


QUICK = Plan(sessions=2, turns=2, rounds=2, scale=1)
FULL = Plan(sessions=4, turns=3, rounds=3, scale=3)

# The stages run with glibc's mmap threshold fixed at its initial 128 KiB: every larger block
# (torch's tensors) is mapped on its own and unmapped when freed, so VmRSS follows live memory.
# With the default, glibc raises the threshold after the first frees and keeps later tensors in
# its heap, and the worker's VmRSS swung by -17 to +24 MB from one replay of the same turns to the
# next, more than the 5 MB a case may add; with it, by under 1 MB (docs/benchmarks.md).
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "hostile", help="garbage records, malformed frames, floods and slow readers beside normal sessions: "
                        "crashes, affected turns, memory growth")
    p.add_argument("--quick", action="store_true", help=f"{QUICK.sessions} sessions x {QUICK.turns} turns, "
                                                         f"{QUICK.rounds} hostile rounds (a few minutes on an idle machine)")
    p.add_argument("--sessions", type=int, default=None, help=f"normal sessions (default {FULL.sessions})")
    p.add_argument("--turns", type=int, default=None, help=f"turns per normal session (default {FULL.turns})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"hostile rounds (default {FULL.rounds}; 0: none, the cases alone)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hostile inputs (the model's seed is fixed)")
    p.add_argument("--control", action="store_true",
                   help="rounds without any hostile input: shows that the comparison itself is deterministic "
                        "(0 affected expected)")
    add_json_argument(p)
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated hostile parts to run (default all: {','.join(PARTS)})")
    p.add_argument("--cases", default=None,
                   help="comma-separated named attacks run one by one after the rounds, each scored on its own "
                        "(default all: " + ",".join(CASES) + "; none: the rounds only)")
    p.add_argument("--logs", type=Path, default=None, help="write each stage's last output lines to DIR/<stage>.log")
    add_stage_log_level(p)
    p.set_defaults(func=run)


def plan_of(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else FULL
    return Plan(sessions=args.sessions or base.sessions, turns=args.turns or base.turns,
                rounds=base.rounds if args.rounds is None else args.rounds, scale=base.scale, token_ms=base.token_ms)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from voicebus.cli import write_json
    from voicebus.logs import configure_logging
    from voicebus.ops.bench.cli import bootstrap_given

    log_level = getattr(args, "log_level", None)
    configure_logging(log_level)
    parts = set() if args.control else {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - set(PARTS):
        print(f"bench hostile: unknown parts {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    try:
        cases = [] if args.control else parse_cases(args.cases)
    except ValueError as exc:
        print(f"bench hostile: {exc}", file=sys.stderr)
        return 2
    results = asyncio.run(run_bench(settings, plan_of(args), seed=args.seed, parts=parts, progress=_print,
                                    start_broker=not bootstrap_given(args), log_level=log_level, cases=cases))
    # the result keys, then the memory figures that tell a leak from a high-water mark, then the cases
    summary = ({k: results[k] for k in RESULT_KEYS} | {k: results[k] for k in ("memory_per_round_mb", "rss_mb")}
               | {"cases": {name: {k: v for k, v in r.items() if k not in ("affected", "died")}
                            for name, r in results["cases"].items()},
                  "cases_warm_up": results["cases_warm_up"]})
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        for stage, text in results["logs"].items():
            (args.logs / f"{stage}.log").write_text(text + "\n")
    for key in ("affected", "closes", "died", "tails"):
        if results.get(key):
            print(f"{key}: {json.dumps(results[key], indent=1)}", file=sys.stderr)
    for name, r in results["cases"].items():
        if r["affected"] or r["died"]:
            print(f"case {name}: died {r['died']}, affected {json.dumps(r['affected'], indent=1)}", file=sys.stderr)
    if args.json != "-":  # the summary is this benchmark's report (with `--json -`, it is that alone)
        print(json.dumps(summary, indent=1))
    write_json(args.json, summary, indent=1)
    if results["cases"]:
        print(format_cases(results["cases"]), file=sys.stderr)
    ok = (summary["processes_died"] == 0 and summary["normal_turns_affected"] == 0
          and all(case_ok(r) for r in results["cases"].values()))
    over = [name for name, r in results["cases"].items() if not memory_ok(r)]
    if over:
        print(f"bench hostile: attack-only memory growth over {MEMORY_TARGET_MB:g} MB on a stage: {', '.join(over)}",
              file=sys.stderr)
    print("bench hostile:", ("0 crashes, 0 normal turns affected" + (", every case's rejection reported"
                                                                      if results["cases"] else ""))
          if ok else "TARGET MISSED", file=sys.stderr)
    return 0 if ok else 1


def memory_per_round(rss: dict[str, list[float]]) -> dict[str, float | None]:
    """Per stage, the median change of resident memory from one hostile round to the next, after
    the first (`rss` lists: after the clean run, then after each round). A leak adds about the
    same every round; a high-water mark is a step (a larger forward pass than any before) and
    allocator releases are steps down, and the median of the round-to-round changes ignores both
    where `memory_growth_mb` (last minus first) does not. None with fewer than two such changes."""
    import statistics

    out: dict[str, float | None] = {}
    for name, series in rss.items():
        deltas = [b - a for a, b in zip(series[1:], series[2:])]  # round 1 -> 2, 2 -> 3, ...
        out[name] = round(statistics.median(deltas), 2) if len(deltas) >= 2 else None
    return out


RESULT_KEYS = ("inputs", "processes_died", "normal_turns", "normal_turns_affected", "memory_growth_mb")


def _print(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- settings of the run ---------------------------------------------------------------------


def bench_settings(settings: Settings) -> Settings:
    """`settings` with topics of this run only (a broker shared with others is fine), a secret
    of its own, the edge on a free loopback port and PCM16 audio (what the hashes compare)."""
    uid = uuid.uuid4().hex[:8]
    p = f"hostile{uid}"
    return settings.replace(
        text_topic_prefix=f"{p}.text.", control_topic=f"{p}.control", synthesis_topic=f"{p}.synthesis",
        audio_topic=f"{p}.audio", playback_topic=f"{p}.playback", heard_topic=f"{p}.heard",
        deadletter_topic=f"{p}.deadletter", agents_topic=f"{p}.agents", gate_app_id=f"{p}-gate",
        gate_changelog_topic=f"{p}-gate-gate_sessions-changelog", edge_host="127.0.0.1", edge_port=0,
        edges_topic=f"{p}.edges", edge_secret=secrets.token_hex(16), audio_encoding="pcm16", tracing=False,
        # few enough players that the pre-hello-flood case fills the edge (a round needs about 25)
        edge_max_clients=min(settings.edge_max_clients, EDGE_MAX_CLIENTS),
        # few enough sessions that the session-flood case goes past the gate's bound (a round opens
        # about 10, idle ones are forgotten first)
        gate_max_sessions=min(settings.gate_max_sessions, GATE_MAX_SESSIONS),
        # the segmenter's bound low enough that a run-on turn reaches it at a cost the tiny model
        # can pay on a CPU (at the default 2048 characters one such turn is minutes of audio)
        gate_max_buffer_chars=min(settings.gate_max_buffer_chars, 256))


# --- normal sessions ---------------------------------------------------------------------------


def sentence_hashes(turn) -> list[str]:
    """SHA-256 of each sentence's PCM16 as the player received it, in sentence order."""
    per: dict[int, bytearray] = {}
    offset = 0
    for _received, sentence, _chunk, samples in turn.frames:
        per.setdefault(sentence, bytearray()).extend(turn.pcm[offset:offset + 2 * samples])
        offset += 2 * samples
    return [hashlib.sha256(bytes(per[s])).hexdigest()[:16] for s in sorted(per)]


@dataclass
class HeardResult:
    key: tuple[int, int]  # (session index, turn index): the same text in every run
    ended: bool
    end_reason: str
    hashes: list[str]


async def normal_sessions(stack, publisher, plan: Plan, label: str,
                          before_turns: Callable[[list[str]], Awaitable[None]] | None = None) -> list[HeardResult]:
    """Every normal session speaks its turns (sessions at once, turns in order); returns what
    each session's player heard."""
    from voicebus.agents.tokens import split_like_llm
    from voicebus.players.listener import Listener

    s = stack.settings
    session_ids = [f"normal-{label}-{i}-{uuid.uuid4().hex[:6]}" for i in range(plan.sessions)]
    listeners = [Listener(stack.edge_url, sid, s.edge_secret) for sid in session_ids]
    async with contextlib.AsyncExitStack() as exits:
        for listener in listeners:
            await exits.enter_async_context(listener)
        if before_turns is not None:
            await before_turns(session_ids)

        async def one_session(i: int) -> list[HeardResult]:
            heard = []
            for t in range(plan.turns):
                text = NORMAL_TEXTS[(i + t) % len(NORMAL_TEXTS)]
                turn_id = f"turn-{t}-{uuid.uuid4().hex[:6]}"
                async with publisher.turn(session_ids[i], turn_id, language="en") as turn:
                    for piece in split_like_llm(text):
                        await turn.token(piece)
                        await asyncio.sleep(plan.token_ms / 1000)
                try:
                    got = await listeners[i].wait_turn_end(turn_id, TURN_TIMEOUT_S)
                    heard.append(HeardResult((i, t), True, got.end_reason, sentence_hashes(got)))
                except TimeoutError:
                    partial = listeners[i].turns.get(turn_id)
                    why = ("nothing heard" if partial is None else
                           f"{len(partial.frames)} frames, stopped={partial.stopped}, cancelled_at={partial.cancelled_at_us}")
                    heard.append(HeardResult((i, t), False, why, sentence_hashes(partial) if partial else []))
            return heard

        results = await asyncio.gather(*(one_session(i) for i in range(plan.sessions)))
    return [r for session in results for r in session]


def affected(clean: list[HeardResult], hostile: list[HeardResult]) -> list[tuple[tuple[int, int], str]]:
    """The hostile run's turns that differ from the clean run's, with why."""
    reference = {r.key: r for r in clean}
    bad = []
    for r in hostile:
        ref = reference[r.key]
        if not r.ended:
            bad.append((r.key, f"no turn_end ({r.end_reason or 'nothing heard'})"))
        elif r.end_reason:
            bad.append((r.key, f"turn_end reason {r.end_reason!r}"))
        elif r.hashes != ref.hashes:
            bad.append((r.key, f"audio differs: {r.hashes} vs clean {ref.hashes}"))
    return bad


# --- the hostile agent: records on the topics --------------------------------------------------


def raw_avro(codec, message_type: str, value: dict) -> bytes:
    """`value` in the wire format, bypassing the contract's checks (what a careless or hostile
    producer with its own Avro library can write)."""
    from fastavro import parse_schema, schemaless_writer

    from voicebus import schemas
    from voicebus.codecs import MAGIC

    buf = io.BytesIO()
    buf.write(MAGIC + codec.fingerprint_of(message_type))
    schemaless_writer(buf, parse_schema(schemas.load(message_type)), value)
    return buf.getvalue()


def _text(session_id: str, turn_id: str, seq: int, kind: str = "TOKEN", text: str = "", **extra) -> TextEvent:
    return TextEvent(**{"session_id": session_id, "turn_id": turn_id, "agent_id": HOSTILE_AGENT, "seq": seq,
                        "kind": TextEventKind(kind), "text": text, "produced_at_us": 1, **extra})


def _request(session_id: str, turn_id: str, seq: int, text: str, **extra) -> SynthesisRequest:
    return SynthesisRequest(**{
        "session_id": session_id, "turn_id": turn_id, "agent_id": HOSTILE_AGENT, "sentence_seq": seq,
        "text": text, "language": "en", "voice": "af_heart", "speed": 1.0, "is_last_in_turn": False,
        "first_token_at_us": 1, "text_complete_at_us": 1, "released_at_us": 1, "tentative": False, **extra})


def _chunk(session_id: str, turn_id: str, sentence: int, chunk: int, pcm: bytes = b"\x00\x00" * 240, **extra) -> AudioChunk:
    return AudioChunk(**{
        "session_id": session_id, "turn_id": turn_id, "sentence_seq": sentence, "chunk_seq": chunk,
        "is_last_chunk": False, "is_last_in_turn": False, "sample_rate": 24000, "encoding": AudioEncoding.PCM16LE,
        "pcm": pcm, "worker_id": "hostile", "first_token_at_us": 0, "text_complete_at_us": 0,
        "released_at_us": 0, "request_received_at_us": 0, "synthesis_started_at_us": 0,
        "audio_ready_at_us": 0, "published_at_us": 0, "end_reason": "", "words": (), **extra})


def _cancel(session_id: str, turn_id: str | None = None, **extra) -> dict:
    return {"session_id": session_id, "turn_id": turn_id, "action": "CANCEL", "reason": "hostile",
            "source": "hostile", "issued_at_us": 1, "turn_ids": [], **extra}


FAR_FUTURE_US = 4_102_444_800_000_000  # 2100-01-01
KIND_HEADER = "voicebus.bench.kind"
# kinds of records every stage must refuse (dead-letter); the others are valid records that must
# merely do no harm (a cancel flood, a request for a voice nobody has, a seq far ahead)
REFUSED_KINDS = ("garbage", "empty", "null-value", "null-key", "negative-seq", "oversized", "unknown-language",
                 "bad-id", "invalid-utf8", "wrong-type", "truncated", "negative-time", "bad-speed", "odd-pcm",
                 "bad-sample-rate", "bad-opus", "words-backwards", "too-many-turn-ids")


class HostileAgent:
    """Publishes garbage and edge cases; counts what it sent by kind."""

    def __init__(self, settings: Settings, producer, publisher, rng: random.Random, scale: int) -> None:
        from voicebus.codecs import codec_for

        self.s = settings
        self.producer = producer  # raw bytes, any key, any partition
        self.publisher = publisher  # valid events through the SDK (its own text topic)
        self.codec = codec_for(settings)
        self.rng = rng
        self.scale = scale
        self.inputs: Counter[str] = Counter()
        self.topic = f"{settings.text_topic_prefix}{HOSTILE_AGENT}"

    def sid(self) -> str:
        return f"hostile-{uuid.uuid4().hex[:8]}"

    async def send(self, kind: str, topic: str, value: bytes | None, key: bytes | None, **kw: Any) -> None:
        # the kind in a header: an operator reading the dead-letter topic sees what the bench sent
        await self.producer.send_and_wait(topic, value, key=key, headers=[(KIND_HEADER, kind.encode())], **kw)
        self.inputs[kind] += 1

    def garbage(self) -> bytes:
        return self.rng.randbytes(self.rng.randrange(0, 200))

    async def records(self, normal_keys: list[bytes]) -> None:
        """One pass over every kind of bad record, `scale` times each."""
        from voicebus.codecs import MAGIC

        s, c, rng = self.s, self.codec, self.rng
        keys = normal_keys or [b"x"]
        for _ in range(self.scale):
            sid = self.sid()
            key = sid.encode()
            for topic, name in ((self.topic, "text"), (s.control_topic, "control"),
                                (s.synthesis_topic, "synthesis"), (s.audio_topic, "audio")):
                # undecodable bytes, under a normal session's key: on the normal turns' partitions
                await self.send(f"{name}:garbage", topic, self.garbage(), rng.choice(keys))
                await self.send(f"{name}:garbage", topic, MAGIC + rng.randbytes(8) + self.garbage(), rng.choice(keys))
                await self.send(f"{name}:empty", topic, b"", rng.choice(keys))
                await self.send(f"{name}:null-value", topic, None, rng.choice(keys))
                await self.send(f"{name}:null-key", topic, self.garbage(), None)
            # text topic: what Avro allows and the contract does not, and turns that never behave
            t = self.topic
            await self.send("text:negative-seq", t, raw_avro(c, "TextEvent", _text(sid, "t1", -5, text="Hi. ").to_record()), key)
            await self.send("text:oversized", t, raw_avro(c, "TextEvent", _text(sid, "t1", 0, text="a" * 20_000).to_record()), key)
            await self.send("text:unknown-language", t, raw_avro(c, "TextEvent", _text(sid, "t2", 0, text="Hi. ", language="de").to_record()), key)
            await self.send("text:bad-id", t, raw_avro(c, "TextEvent", _text("\x00\x01bad", "t\n", 0, text="Hi. ").to_record()), b"\x00\x01bad")
            await self.send("text:invalid-utf8", t, raw_avro(c, "TextEvent", _text(sid, "t3", 0, text="XYZW").to_record()).replace(
                b"XYZW", b"\xff\xfe\xfd\xfc"), key)
            await self.send("text:wrong-type", t, c.encode("ControlEvent", _cancel(sid)), key)
            await self.send("text:wrong-partition", t, c.encode("TextEvent", _text(sid, "t4", 0, text="Hello there. ")),
                            key, partition=(self._partition(key) + 1) % s.partitions)
            await self.send("text:truncated", t, c.encode("TextEvent", _text(sid, "t5", 0, text="Hello. "))[:-3], key)
            # valid but nasty turns, through the SDK: run-on text, an unclosed code fence,
            # events after the end, a turn that never ends, duplicated and skipped seqs
            await self._turn("text:run-on", sid, [f"word{i % 10} " for i in range(50)])  # past the 256-char bound
            await self._turn("text:unclosed-fence", self.sid(), ["Look:\n", "```", "python\n", *(["x = 1\n"] * 400)])
            await self._turn("text:emoji-and-controls", self.sid(), ["🙂🙃", " \u200b\u202e", " ok.", " ", "\t\t"])
            never = self.sid()
            await self.send("text:never-ended", t, c.encode("TextEvent", _text(never, "open", 0, text="This turn never ends")), never.encode())
            for seq in (0, 0, 7, 3):
                await self.send("text:seq-replayed-or-skipped", t, c.encode("TextEvent", _text(sid, "dup", seq, text=f"Dup {seq}. ")), key)
            await self.send("text:after-end", t, c.encode("TextEvent", _text(sid, "dup", 8, kind="END_OF_TURN")), key)
            await self.send("text:after-end", t, c.encode("TextEvent", _text(sid, "dup", 9, text="After the end. ")), key)
            # control topic
            ctl = s.control_topic
            await self.send("control:far-future-cancel", ctl, c.encode("ControlEvent", _cancel(sid, issued_at_us=FAR_FUTURE_US)), key)
            for _ in range(100):
                await self.send("control:cancel-flood-made-up-ids", ctl,
                                c.encode("ControlEvent", _cancel(sid, f"made-up-{rng.getrandbits(48):x}")), key)
            await self.send("control:too-many-turn-ids", ctl, raw_avro(
                c, "ControlEvent", _cancel(sid, None, turn_ids=[f"t{i}" for i in range(2000)])), key)
            await self.send("control:bad-id", ctl, raw_avro(c, "ControlEvent", _cancel("")), b"")
            await self.send("control:negative-time", ctl, raw_avro(c, "ControlEvent", _cancel(sid, issued_at_us=-1)), key)
            # synthesis topic (only the gate should write it): what a buggy gate could send
            syn = s.synthesis_topic
            await self.send("synthesis:negative-seq", syn, raw_avro(c, "SynthesisRequest", _request(sid, "r", -1, "Hi.").to_record()), key)
            await self.send("synthesis:unknown-language", syn, raw_avro(c, "SynthesisRequest", _request(sid, "r", 0, "Hi.", language="x").to_record()), key)
            await self.send("synthesis:oversized", syn, raw_avro(c, "SynthesisRequest", _request(sid, "r", 1, "a " * 10_000).to_record()), key)
            await self.send("synthesis:bad-speed", syn, raw_avro(c, "SynthesisRequest", _request(sid, "r", 2, "Hi.", speed=float("nan")).to_record()), key)
            await self.send("synthesis:unknown-voice", syn, c.encode("SynthesisRequest", _request(sid, "r", 3, "Hi.", voice="nobody")), key)
            await self.send("synthesis:empty-text", syn, c.encode("SynthesisRequest", _request(sid, "r", 4, "")), key)
            await self.send("synthesis:punctuation-only", syn, c.encode("SynthesisRequest", _request(sid, "r", 5, "?!.,;:-- ...")), key)
            await self.send("synthesis:huge-seq", syn, c.encode("SynthesisRequest", _request(sid, "r", 2**31 - 1, "Last.", is_last_in_turn=True)), key)
            # audio topic (only workers should write it)
            aud = s.audio_topic
            await self.send("audio:negative-seq", aud, raw_avro(c, "AudioChunk", _chunk(sid, "a", -1, 0).to_record()), key)
            await self.send("audio:negative-seq", aud, raw_avro(c, "AudioChunk", _chunk(sid, "a", 0, -7).to_record()), key)
            await self.send("audio:odd-pcm", aud, raw_avro(c, "AudioChunk", _chunk(sid, "a", 0, 0, pcm=b"\x01\x02\x03").to_record()), key)
            await self.send("audio:bad-sample-rate", aud, raw_avro(c, "AudioChunk", _chunk(sid, "a", 0, 1, sample_rate=-1).to_record()), key)
            await self.send("audio:bad-opus", aud, raw_avro(c, "AudioChunk", _chunk(
                sid, "a", 0, 2, encoding=AudioEncoding.OPUS, pcm=b"\xff\xff\x01").to_record()), key)
            await self.send("audio:words-backwards", aud, raw_avro(c, "AudioChunk", _chunk(
                sid, "a", 0, 3, words=(WordTiming(text="x", start=9, end=1),)).to_record()), key)
            await self.send("audio:huge-seq", aud, c.encode("AudioChunk", _chunk(sid, "a", 2**31 - 1, 2**31 - 1, is_last_chunk=True)), key)
            for i in range(50):  # a session nobody listens to: the edge must build nothing for it
                await self.send("audio:unheard-session", aud, c.encode("AudioChunk", _chunk(self.sid(), "u", 0, i)), key)

    def _partition(self, key: bytes) -> int:
        from aiokafka.partitioner import murmur2

        return (murmur2(key) & 0x7FFFFFFF) % self.s.partitions

    async def _turn(self, kind: str, session_id: str, pieces: list[str]) -> None:
        async with self.publisher.turn(session_id, agent_id=HOSTILE_AGENT) as turn:
            for piece in pieces:
                await turn.token(piece)
        self.inputs[kind] += 1

    async def far_future_cancels(self, session_ids: list[str]) -> None:
        """A whole-session cancel from the far future for each normal session, before its turns."""
        for sid in session_ids:
            await self.send("control:far-future-cancel-of-normal-session", self.s.control_topic,
                            self.codec.encode("ControlEvent", _cancel(sid, issued_at_us=FAR_FUTURE_US)), sid.encode())


# --- hostile clients ---------------------------------------------------------------------------


class HostileClients:
    """WebSocket clients that misbehave; counts what they tried by kind, and the close codes."""

    def __init__(self, edge_url: str, secret: str, rng: random.Random, scale: int) -> None:
        self.url = edge_url.rstrip("/") + "/ws"
        self.secret = secret
        self.rng = rng
        self.scale = scale
        self.inputs: Counter[str] = Counter()
        self.closes: Counter[str] = Counter()
        self.slow: list[Any] = []  # (http, ws) of clients that never read, closed at the end

    def _hello(self, session_id: str, **extra) -> str:
        from voicebus.players import protocol
        from voicebus.players.auth import issue_token

        return protocol.encode_control(protocol.HELLO, session=session_id,
                                       token=issue_token(self.secret, session_id, 600), **extra)

    async def _try(self, kind: str, frames: list[Any], session_id: str | None = None, hello: bool = True) -> None:
        import aiohttp

        self.inputs[kind] += 1
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(self.url, max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
                    if hello:
                        await ws.send_str(self._hello(session_id or f"hostile-{uuid.uuid4().hex[:8]}"))
                    for frame in frames:
                        if isinstance(frame, bytes):
                            await ws.send_bytes(frame)
                        else:
                            await ws.send_str(frame)
                    with contextlib.suppress(asyncio.TimeoutError):
                        async with asyncio.timeout(5):
                            async for _msg in ws:
                                pass
                    self.closes[f"{kind}:{ws.close_code}"] += 1
            except (aiohttp.ClientError, ConnectionError) as exc:
                self.closes[f"{kind}:{type(exc).__name__}"] += 1

    async def run(self, normal_sessions: list[str]) -> None:
        from voicebus.players import protocol

        rng = self.rng
        for _ in range(self.scale):
            await self._try("ws:not-json", ["{not json", "\xff\x00"])
            await self._try("ws:binary-frame", [b"\x01\x01" + rng.randbytes(40)])
            await self._try("ws:wrong-types", [json.dumps({"type": "cancel", "v": 1, "turn_id": 5})])
            await self._try("ws:unknown-type", [json.dumps({"type": "sudo", "v": 1})])
            await self._try("ws:json-array", ["[1,2,3]"])
            await self._try("ws:negative-numbers", [json.dumps({"type": "report", "v": 1, "kind": "AUDIBLE_START",
                                                                "turn_id": "t", "sentence_seq": -1})])
            await self._try("ws:huge-text-frame", ["x" * (protocol.MAX_TEXT_FRAME_BYTES + 10)])
            await self._try("ws:over-message-limit", ["y" * (protocol.MAX_WS_MESSAGE_BYTES + 10)])
            await self._try("ws:second-hello", [self._hello("hostile-again")])
            await self._try("ws:bad-token", [protocol.encode_control(protocol.HELLO, session="s", token="forged.token")],
                            hello=False)
            await self._try("ws:token-for-another-session", [
                protocol.encode_control(protocol.HELLO, session=normal_sessions[0] if normal_sessions else "n",
                                        token=self._hello("other").split('"token":"')[1].split('"')[0])], hello=False)
            await self._try("ws:wrong-version", [json.dumps({"type": "hello", "v": 99, "session": "s", "token": "t"})],
                            hello=False)
            await self._try("ws:cancel-flood", [protocol.encode_control(
                protocol.CANCEL, turn_id=f"made-up-{rng.getrandbits(40):x}") for _ in range(300)])
            await self._try("ws:report-garbage", [protocol.encode_control(
                protocol.REPORT, kind=rng.choice(["AUDIBLE_START", "STOPPED", "NOPE"]), turn_id=f"t{i}",
                audible_at_us=rng.choice([0, 2**62, 2**70]), detail="d" * 600) for i in range(20)])
            await self._try("ws:ping-flood", [protocol.encode_control(protocol.PING, t0=i) for i in range(200)])
            # more connections to one session than it may have, and each of them gone at once
            crowd = f"hostile-crowd-{uuid.uuid4().hex[:6]}"
            await asyncio.gather(*(self._try("ws:connection-flood", [], session_id=crowd) for _ in range(12)))

    async def slow_readers(self, session_ids: list[str]) -> None:
        """A second player of each of these sessions that sends hello and never reads again."""
        import aiohttp

        for sid in session_ids:
            http = aiohttp.ClientSession()
            try:
                ws = await http.ws_connect(self.url, max_msg_size=0)
                await ws.send_str(self._hello(sid))
                self.slow.append((http, ws))
                self.inputs["ws:slow-reader"] += 1
            except (aiohttp.ClientError, ConnectionError):
                await http.close()

    async def close(self) -> None:
        for http, ws in self.slow:
            with contextlib.suppress(Exception):
                await ws.close()
            await http.close()
        self.slow.clear()


# what each stage counts when it applies a control event (gate, worker: their own --metrics-port)
CANCEL_COUNTERS = {"gate": "voicebus_gate_control_events_total", "worker": "voicebus_worker_cancels_seen_total",
                   "edge": "voicebus_edge_cancels_total"}


async def cancels_applied(stack) -> dict[str, float]:
    """Control events each stage has applied so far, once the counts stop moving (what the
    previous round left on the control topic is applied first)."""
    last: dict[str, float] | None = None
    deadline = time.monotonic() + 60
    while True:
        now = {stage: await stack.metric(stage, name) for stage, name in CANCEL_COUNTERS.items()}
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        await asyncio.sleep(0.5)


async def wait_cancels_applied(stack, before: dict[str, float], n: int, timeout_s: float = 60.0) -> None:
    """Until every stage has applied `n` more control events than `before`: a cancel sent
    "before a turn" is one every stage applied before the turn's first token was sent."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {stage: await stack.metric(stage, name) for stage, name in CANCEL_COUNTERS.items()}
        if all(now[stage] >= before[stage] + n for stage in before):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"stages did not apply {n} cancels: before {before}, now {now}")
        await asyncio.sleep(0.1)


# --- the run -----------------------------------------------------------------------------------


async def run_bench(settings: Settings, plan: Plan, *, seed: int = 0, parts: set[str] | frozenset[str] = frozenset(PARTS),
                    progress: Callable[[str], None] = lambda m: None, start_broker: bool = True,
                    log_level: str | None = None, cases: list[str] | tuple[str, ...] = ()) -> dict:
    """The whole benchmark; returns the result keys plus detail (``affected``, ``rss_mb``,
    ``closes``, ``died``) and ``cases`` (name -> figures, `hostile_cases.run_cases`).
    `start_broker`: start a throwaway broker when none answers at the settings' bootstrap;
    `log_level`: the stage processes' (each its own default when None); `cases`: the named
    attacks to run after the rounds, in order."""
    registry = await CountingRegistry().start() if "unknown-schema-flood" in cases else None
    try:
        return await _run_bench(settings, plan, seed=seed, parts=parts, progress=progress, start_broker=start_broker,
                                log_level=log_level, cases=list(cases), registry=registry)
    finally:
        if registry is not None:
            await registry.stop()


async def _run_bench(settings: Settings, plan: Plan, *, seed: int, parts, progress, start_broker: bool,
                     log_level: str | None, cases: list[str], registry: "CountingRegistry | None") -> dict:
    from voicebus.agents.sdk import Publisher
    from voicebus.ops.bench.stages import StageProcesses
    from voicebus.ops.cluster import ensure_local_kafka
    from voicebus.bus import ensure_topics, make_producer
    from voicebus.topics import fixed_topics, text_topic

    rng = random.Random(seed)
    with ensure_local_kafka(bench_settings(settings), start=start_broker) as s:
        if registry is not None:  # the stages ask it about schema ids they do not know
            s = s.replace(registry_url=registry.url)
        await ensure_topics(s, [*fixed_topics(s), text_topic(s, NORMAL_AGENT), text_topic(s, HOSTILE_AGENT)])
        progress(f"starting gate, worker (tiny model) and edge as processes on {s.bootstrap}")
        async with StageProcesses(s, log_level=log_level, env=MEMORY_ENV) as stack, Publisher(stack.settings, NORMAL_AGENT) as publisher, \
                Publisher(stack.settings, HOSTILE_AGENT) as hostile_publisher:
            raw = make_producer(stack.settings, enable_idempotence=False)
            await raw.start()
            try:
                progress(f"clean run: {plan.sessions} sessions x {plan.turns} turns")
                clean = await normal_sessions(stack, publisher, plan, "clean")
                if not all(r.ended and not r.end_reason for r in clean):
                    raise RuntimeError(f"the clean run did not end every turn cleanly: {clean}")
                baseline = stack.rss_mb()
                rss = {name: [round(mb, 1)] for name, mb in baseline.items()}
                agent = HostileAgent(stack.settings, raw, hostile_publisher, rng, plan.scale)
                clients = HostileClients(stack.edge_url, stack.settings.edge_secret, rng, plan.scale)
                bad: list = []
                normal_turns = 0
                for round_no in range(1, plan.rounds + 1):
                    progress(f"hostile round {round_no}/{plan.rounds}")
                    round_keys: list[bytes] = []
                    hostile_tasks: list[asyncio.Task] = []

                    async def before(session_ids: list[str]) -> None:
                        round_keys.extend(sid.encode() for sid in session_ids)
                        if "far-future" in parts:
                            counts = await cancels_applied(stack)
                            await agent.far_future_cancels(session_ids)
                            await wait_cancels_applied(stack, counts, len(session_ids))
                        if "slow-readers" in parts:
                            await clients.slow_readers(session_ids)
                        if "records" in parts:
                            hostile_tasks.append(asyncio.create_task(agent.records(round_keys)))
                        if "clients" in parts:
                            hostile_tasks.append(asyncio.create_task(clients.run(session_ids)))

                    heard = await normal_sessions(stack, publisher, plan, f"r{round_no}", before_turns=before)
                    await asyncio.gather(*hostile_tasks)
                    await clients.close()
                    normal_turns += len(heard)
                    bad += affected(clean, heard)
                    for name, mb in stack.rss_mb().items():
                        rss[name].append(round(mb, 1))
                    if round_no == 1 and plan.rounds > 1:
                        # the first round sets each stage's high-water marks (the largest forward
                        # pass, first use of each error path); growth is measured from there
                        baseline = stack.rss_mb()
                    progress(f"  affected so far {len(bad)}, rss {stack.rss_mb()}")
                inputs = agent.inputs + clients.inputs
                end = stack.rss_mb()
                case_results, warm_up = {}, {}
                if cases:
                    helpers = Helpers(raw_avro, _text, _cancel, KIND_HEADER, CANCEL_COUNTERS, normal_sessions, affected)
                    ctx = CaseContext(stack, raw, agent.codec, rng, plan.scale, helpers, registry=registry,
                                      hostile_topic=agent.topic)
                    case_results, warm_up = await run_cases(stack, publisher, plan, clean, cases, ctx, progress)
                died = stack.died()
                return {
                    "inputs": dict(sorted(inputs.items())),
                    "processes_died": len(died),
                    "normal_turns": normal_turns,
                    "normal_turns_affected": len(bad),
                    "memory_growth_mb": {name: round(end[name] - baseline[name], 1) for name in baseline},
                    "memory_per_round_mb": memory_per_round(rss),
                    "affected": [f"{key}: {why}" for key, why in bad],
                    "rss_mb": rss, "closes": dict(sorted(clients.closes.items())), "died": died,
                    "tails": {st.name: st.tail(15) for st in stack.stages if st.died()},
                    "cases": case_results, "cases_warm_up": warm_up,
                    "logs": {st.name: st.tail(300) for st in stack.stages},
                }
            finally:
                await raw.stop()
