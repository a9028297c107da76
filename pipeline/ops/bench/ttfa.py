"""`voicebus bench ttfa`: time to first audio, incremental vs buffered hand-off, same everything else.

Two lanes run side by side on one broker, one edge and one loaded engine: *incremental* (the gate
releases each sentence to synthesis as soon as it is certain) and *buffered* (the gate waits for
the end of the turn and sends the whole answer as one request). The only difference is
`Settings.gate_mode`. An agent streams LLM-like tokens (word pieces, a fixed interval) of answers
of 1, 4 and 7+ sentences; a headless listener on the edge's WebSocket receives the audio. Time to
first audio runs from the turn's first token to the first audio frame the listener receives.

Runs alternate the two modes (A/B in one run, on a noisy 2-core machine) and report p50/p95,
the ratio buffered/incremental, the per-stage breakdown, concurrency (sessions at once: time to
first audio and the silence a player would hit between chunks), the overhead the bus, gate and
edge add, and the cancel benchmark (cancel sent -> last audio received, chunks of the cancelled
turn delivered after the cancel), and the one-shot comparison of `voicebus.ops.bench.oneshot`:
a whole text at once through the OpenAI-compatible endpoint (first byte of ``/v1/audio/speech``)
vs the native path (SDK publish, WebSocket listener).

With `--browser`, every measured session also has the real web player open in one headless
chromium (a page per session, closed after its turn): the page is started and connected before
the agent's first token, and its AUDIBLE_START report (the server-clock time its AudioWorklet
rendered the turn's first non-silent sample) adds the "audible" stage, `audible_ms` summaries and
`ratio_audible_p50`. The cancel benchmark then barges in once the page is audible and adds the
time from cancel sent until the page's worklet renders silence (its STOPPED report), checking
that no sound is rendered after it. Without `--browser` nothing of this runs.

With `--tracing`, a third lane *traced* (incremental, tracing on, spans exported nowhere) takes
its turn in the rotation of the single-session runs; the results add its TTFA and overhead p50
beside the untraced incremental lane's (the difference is tracing's cost end to end, within the
machine's noise) and the in-process cost of the tracing calls one sentence's first audio goes
through (`tracing_path_cost_us`), which resolves far below that noise.

The broker: the one at ``VOICEBUS_BOOTSTRAP`` when it answers, else a throwaway one started for the
run and stopped after it; given ``--bootstrap``, that one, and none started.

Size: about 710 lines: one benchmark (its lanes, listener, statistics, table and chart). Benchmarks
are not on the runtime path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import uuid
from pathlib import Path

from voicebus.cli import add_json_argument, write_json
from voicebus.clock import now_us
from voicebus.latency import first_audio_stages, model_ttfa_ms, overhead_ms, summary
from voicebus.logs import configure_logging
from voicebus.ops.bench import oneshot as oneshot_bench
from voicebus.ops.bench.cli import add_stage_log_level, bootstrap_given
from voicebus.settings import Settings
from voicebus.schemas.contract import PlaybackKind
from voicebus.schemas.messages import PlaybackReport

SENTENCES = [
    "Thanks for waiting, I found your order.",
    "It shipped on Monday from our warehouse in Denver.",
    "The carrier expects to deliver it by Thursday afternoon.",
    "You can follow the package with the tracking link in your e-mail.",
    "If nobody is home, the driver will leave it at the front desk.",
    "Returns are free for thirty days after delivery.",
    "Is there anything else I can help you with today?",
    "Have a great rest of your week.",
]
STAGE_ORDER = ["sentence complete", "released", "request received", "synthesis start", "first audio",
               "published", "edge received", "sent", "received", "audible"]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--autoplay-policy=no-user-gesture-required",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]
PAGE_READY = ("window.voicebusPlayer && window.voicebusPlayer.state === 'ready' "
              "&& window.voicebusPlayer.clock.samples >= 3")
AUDIBLE_TIMEOUT_S = 30.0


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("ttfa", help="time to first audio: incremental vs buffered hand-off")
    p.add_argument("--quick", action="store_true", help="a reduced set (under five minutes here)")
    add_json_argument(p)
    p.add_argument("--markdown", type=Path, default=None, help="write the results table as markdown")
    p.add_argument("--png", type=Path, default=None, help="write a chart")
    p.add_argument("--runs", type=int, default=None, help="repeats per answer length and mode")
    p.add_argument("--lengths", default=None, help="answer lengths in sentences (default 1,4,7)")
    p.add_argument("--concurrency", default=None, help="sessions at once (default 1,2,4,8; quick 1,2,4)")
    p.add_argument("--token-ms", type=float, default=30.0, help="interval between LLM tokens (default 30 ms)")
    p.add_argument("--tiny", action="store_true", help="tiny random-weight model instead of Kokoro-82M")
    p.add_argument("--tracing", action="store_true",
                   help="A/B of tracing: a third lane, incremental with tracing on (every span made and propagated, "
                        "exported nowhere: VOICEBUS_OTLP_PROTOCOL=none), alternated with the untraced incremental lane "
                        "on single-session turns; reports the difference and the tracing calls' own cost")
    p.add_argument("--browser", action="store_true",
                   help="also play every measured session in the web player in headless chromium (/usr/bin/chromium): "
                        "adds time to audible start and cancel -> silence rendered in the page")
    add_stage_log_level(p)
    p.set_defaults(func=run_ttfa)


def run_ttfa(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console

    configure_logging(getattr(args, "log_level", None))
    console = Console(stderr=True)
    results = asyncio.run(_bench(args, settings, console))
    print_results(results)
    write_json(args.json, results, indent=1)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_table(results))
    if args.png:
        write_chart(results, args.png)
    return 0


def _ints(text: str | None, default: list[int]) -> list[int]:
    return [int(x) for x in text.split(",")] if text else default


async def _bench(args: argparse.Namespace, settings: Settings, console) -> dict:
    from voicebus.ops.daemon import free_port
    from voicebus.ops.demo_shared import load_engine
    from voicebus.ops.runtime import PipelineStack

    lengths = _ints(args.lengths, [1, 4, 7])
    concurrency = _ints(args.concurrency, [1, 2, 4] if args.quick else [1, 2, 4, 8])
    runs = args.runs or (3 if args.quick else 7)
    conc_runs = 1 if args.quick else 3
    tag = uuid.uuid4().hex[:6]
    # the edge's speech endpoint publishes as an agent of the incremental lane (its text prefix)
    base = settings.replace(edge_port=free_port(), control_topic=f"bench-{tag}.control",
                            audio_topic=f"bench-{tag}.audio", playback_topic=f"bench-{tag}.playback",
                            text_topic_prefix=f"bench-{tag}.incremental.text.", speech_api=True)
    traced = bool(getattr(args, "tracing", False))
    if traced:  # the edge serves every lane: it traces what carries a trace context (the traced lane's)
        base = base.replace(tracing=True, otlp_protocol="none")
    lanes = {
        mode: base.replace(gate_mode=gate_mode, text_topic_prefix=f"bench-{tag}.{mode}.text.",
                           synthesis_topic=f"bench-{tag}.{mode}.synthesis", gate_app_id=f"bench-{tag}-{mode}",
                           gate_changelog_topic=f"bench-{tag}-{mode}-gate_sessions-changelog",
                           tracing=mode == "traced")
        for mode, gate_mode in (("incremental", "incremental"), ("buffered", "buffered"), ("traced", "incremental"))
        if mode != "traced" or traced
    }
    single_modes = tuple(lanes)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    engine = await asyncio.to_thread(load_engine, settings, args.tiny, console)
    started = time.monotonic()
    # a bench takes minutes: one bar over every measured step, the per-turn lines scroll above it
    steps = runs * len(lengths) * len(single_modes) + conc_runs * len(concurrency) * 2 + max(2, runs) + 1
    progress = Progress(TextColumn("bench ttfa"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    bar = progress.add_task("steps", total=steps)
    browser = _Browser() if getattr(args, "browser", False) else None
    async with PipelineStack(base, engine, lanes, agent_ids=("bench",), start_broker=not bootstrap_given(args),
                             gate_log_level=getattr(args, "log_level", None) or "WARNING") as stack, \
            contextlib.AsyncExitStack() as exit_stack:
        if browser is not None:
            await exit_stack.enter_async_context(browser)
        exit_stack.enter_context(progress)
        bench = _Bench(stack, args.token_ms, console, browser)
        await bench.warm_up()
        samples: list[dict] = []
        for run in range(runs):
            for length in lengths:
                turn = (run + length) % len(single_modes)  # each mode goes first as often as the others
                modes = single_modes[turn:] + single_modes[:turn]
                for mode in modes:
                    samples += await bench.turns(mode, length, sessions=1, full=False)
                    progress.advance(bar)
        conc: list[dict] = []
        for run in range(conc_runs):
            for n in concurrency:
                for mode in ("incremental", "buffered") if run % 2 == 0 else ("buffered", "incremental"):
                    conc += await bench.turns(mode, 4, sessions=n, full=True)
                    progress.advance(bar)
        cancels = []
        for _ in range(max(2, runs)):
            cancels.append(await bench.cancel_once(7))
            progress.advance(bar)
        texts = [(n, " ".join(SENTENCES[i % len(SENTENCES)] for i in range(n))) for n in lengths]
        oneshot = await oneshot_bench.measure(stack, stack.lanes["incremental"].settings, texts, runs,
                                              bench._workers_idle)
        progress.advance(bar)
    meta = {
        "runs": runs, "lengths": lengths, "concurrency": concurrency, "token_ms": args.token_ms,
        "engine": "tiny random weights" if args.tiny else "Kokoro-82M", "device": getattr(engine, "device", "?"),
        "wall_s": round(time.monotonic() - started, 1), "quick": bool(args.quick),
    }
    if browser is not None:
        meta |= {"browser": "chromium (headless, web player)", "page_errors": browser.errors[:20]}
    results = summarise(samples, conc, cancels, meta)
    results["oneshot"] = oneshot_bench.summarise(oneshot)
    if traced:
        on, off = tracing_path_cost_us(), tracing_path_cost_us(enabled=False)
        results["tracing_path_cost_us"] = summary(on["wall"])
        results["tracing_path_cpu_us"] = summary(on["cpu"])
        results["tracing_off_path_cost_us"] = summary(off["wall"])
    return results


def tracing_path_cost_us(turns: int = 2000, enabled: bool = True) -> dict[str, list[float]]:
    """The tracing calls one sentence's first audio goes through, in-process, per turn (µs): the
    SDK opens the turn and writes its headers, the gate reads them and records its hold, the
    worker reads the request's, records the queue, opens synthesis and publish and writes the
    chunk's headers, the edge reads them and records its send. The spans go to a batch processor
    whose exporter drops them (as with ``VOICEBUS_OTLP_PROTOCOL=none``). ``enabled=False``: the
    same calls on the no-op tracer every stage gets with tracing off. Per turn: ``wall`` (what
    the loop spends, preemption by other processes included) and ``cpu`` (this thread's CPU
    time: the cost itself, which a loaded machine does not inflate)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from voicebus import tracing

    provider = tracing.make_provider(BatchSpanProcessor(tracing.DroppingExporter()))
    tracer = tracing.tracer_for(Settings(tracing=enabled), "bench", provider)
    ids = {tracing.SESSION: "s-1234567890", tracing.TURN: "t-1234567890", tracing.SENTENCE: 0}
    costs: dict[str, list[float]] = {"wall": [], "cpu": []}
    try:
        for _ in range(turns):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            now = now_us()
            root = tracer.start(tracing.TURN_SPAN, None, now, root=True, **ids)
            text_headers = tracer.headers(root.context)
            hold = tracer.record(tracing.GATE_HOLD, tracer.context_of(text_headers), now, now + 1, **ids)
            request = tracer.context_of(tracer.headers(hold))
            tracer.record(tracing.SYNTHESIS_QUEUE, request, now + 1, now + 2, **ids)
            synthesis = tracer.start(tracing.SYNTHESIS, request, now + 2, **ids)
            publish = tracer.start(tracing.PUBLISH, synthesis.context, now + 3, **ids)
            chunk_headers = tracer.headers(publish.context)
            publish.end(now + 4)
            tracer.record(tracing.EDGE_SEND, tracer.context_of(chunk_headers), now + 4, now + 5, **ids)
            costs["wall"].append((time.perf_counter_ns() - t0) / 1000)
            costs["cpu"].append((time.thread_time_ns() - c0) / 1000)
            synthesis.end(now + 6)  # after the first audio: off its path
            root.end(now + 7)
    finally:
        provider.shutdown()
    return costs


class _Browser:
    """One headless chromium for the whole bench; `open(...)` gives a started, connected web
    player page for one session (close it after the turn so memory stays flat)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self._pw = None
        self._browser = None

    async def __aenter__(self) -> _Browser:  # noqa: PYI034
        from playwright.async_api import async_playwright

        self._pw = await async_playwright().start()
        try:
            self._browser = await self._pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        except BaseException:
            await self._pw.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self._browser.close()
        finally:
            await self._pw.stop()

    async def open(self, edge_url: str, session_id: str, secret: str):
        from voicebus.players.auth import issue_token, player_url

        page = await self._browser.new_page()
        page.on("pageerror", lambda exc: self.errors.append(f"{session_id}: {exc}"))
        try:
            await page.goto(player_url(edge_url, session_id, issue_token(secret, session_id, 3600)))
            await page.click("#start")
            await page.wait_for_function(PAGE_READY, timeout=20000)
            # The live waveform redraws a 960 px canvas ~90 times a second; shrink it so the
            # renderer stays cheap next to synthesis on a small machine (audio is untouched).
            await page.evaluate("document.getElementById('wave').width = 2")
        except BaseException:
            await page.close()
            raise
        return page

    async def close_pages(self, pages) -> None:
        for page in pages:
            if page is None:
                continue
            with contextlib.suppress(Exception):
                errors = await page.evaluate("window.voicebusPlayer.errors")
                self.errors += [f"player: {e}" for e in errors or []]
            with contextlib.suppress(Exception):
                await page.close()


class _Bench:
    def __init__(self, stack, token_ms: float, console, browser: _Browser | None = None) -> None:
        self.stack = stack
        self.token_ms = token_ms
        self.console = console
        self.browser = browser

    async def _report(self, session_id: str, turn_id: str, kind: str, timeout: float) -> PlaybackReport | None:
        """The player report `kind` the edge recorded for the session's turn (None on timeout)."""
        from voicebus.players.edge import REPORTS_KEY

        reports = self.stack.edge_app[REPORTS_KEY]
        deadline = time.monotonic() + timeout
        while True:
            for r in reversed(reports):
                if r.session_id == session_id and r.turn_id == turn_id and r.kind == kind:
                    return r
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.01)

    async def warm_up(self) -> None:
        for mode in self.stack.lanes:
            await self.turns(mode, 1, sessions=1, full=True, record=False)

    async def _speak(self, publisher, session_id: str, turn_id: str, text: str) -> list[int]:
        """Stream `text` as LLM-like tokens; returns each token's produced_at_us."""
        from voicebus.agents.tokens import split_like_llm

        produced: list[int] = []
        async with publisher.turn(session_id, turn_id, language="en") as turn:
            for piece in split_like_llm(text):
                event = await turn.token(piece)
                if event:
                    produced.append(event.produced_at_us)
                await asyncio.sleep(self.token_ms / 1000)
        return produced

    async def turns(self, mode: str, length: int, sessions: int, full: bool, record: bool = True) -> list[dict]:
        """`sessions` sessions each speak one answer of `length` sentences at once; returns one
        sample per session. Not `full`: each turn is cancelled once its first audio arrived (the
        rest of the answer does not matter for time to first audio and would slow later runs)."""
        from voicebus.agents.sdk import Publisher
        from voicebus.players.listener import Listener

        lane = self.stack.lanes[mode].settings
        text = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(length))
        ids = [(f"{mode}-{uuid.uuid4().hex[:8]}", "t1") for _ in range(sessions)]
        listeners = [Listener(self.stack.edge_url, sid, lane.edge_secret) for sid, _ in ids]
        pages: list = []
        try:
            for listener in listeners:
                await listener.start()
            if self.browser is not None:  # started and connected before the first token
                for sid, _ in ids:
                    pages.append(await self.browser.open(self.stack.edge_url, sid, lane.edge_secret))
            async with Publisher(lane, agent_id="bench") as publisher:
                produced = await asyncio.gather(*(self._speak(publisher, sid, tid, text) for sid, tid in ids))
                out = []
                for (sid, tid), listener, produced_us in zip(ids, listeners, produced):
                    audible = None
                    if full:
                        turn = await listener.wait_turn_end(tid, 600)
                        if self.browser is not None:
                            audible = await self._report(sid, tid, PlaybackKind.AUDIBLE_START, AUDIBLE_TIMEOUT_S)
                    else:
                        turn = await listener.wait_first_audio(tid, 300)
                        if self.browser is not None:  # the page must become audible before the cancel
                            audible = await self._report(sid, tid, PlaybackKind.AUDIBLE_START, AUDIBLE_TIMEOUT_S)
                        await listener.cancel(tid, reason="bench: first audio measured")
                    out.append(self._sample(mode, length, sessions, turn, produced_us,
                                            audible.audible_at_us if audible else None))
        finally:
            for listener in listeners:
                await listener.stop()
            if self.browser is not None:
                await self.browser.close_pages(pages)
        await self._workers_idle()
        if record:
            s = out[0]
            heard = f", audible {s['audible_ms']:.0f} ms" if s.get("audible_ms") is not None else (
                ", audible: no report" if self.browser is not None else "")
            self.console.log(f"{mode:11s} {length} sentence(s) x{sessions}: first audio {s['ttfa_ms']:.0f} ms{heard}")
        return out

    async def _workers_idle(self, timeout: float = 120.0) -> None:
        """Wait until no synthesis is queued or running, so a run never measures the tail of the
        one before (a forward pass already started finishes even when its turn was cancelled)."""
        async with asyncio.timeout(timeout):
            while any(lane.worker.scheduler.in_flight or lane.worker.scheduler.queue_depth
                      for lane in self.stack.lanes.values()):
                await asyncio.sleep(0.05)

    @staticmethod
    def _sample(mode: str, length: int, sessions: int, turn, produced_us: list[int], audible_at_us: int | None = None) -> dict:
        first_at_us = produced_us[0] if produced_us else 0
        received = turn.first_audio_at_us
        timeline = turn.timelines.get(turn.frames[0][1]) or next(iter(turn.timelines.values()))
        gap_ms, gaps = turn.starvation()
        extra = {} if audible_at_us is None else {"audible_ms": (audible_at_us - timeline["first_token_at_us"]) / 1000}
        return extra | {
            "mode": mode, "sentences": length, "sessions": sessions,
            "ttfa_ms": (received - timeline["first_token_at_us"]) / 1000,
            "stages": first_audio_stages(timeline, received, audible_at_us),
            "model_ttfa_ms": model_ttfa_ms(timeline),
            "overhead_ms": overhead_ms(timeline, received),
            # Part of that overhead is no cost of the bus: a sentence's end is certain only once the
            # next token arrives, one token interval after its last character.
            "confirming_token_wait_ms": _confirming_token_wait_ms(timeline, produced_us),
            "starvation_ms": gap_ms, "starvation_gaps": gaps, "audio_s": turn.duration_s,
            "agent_first_token_skew_ms": (timeline["first_token_at_us"] - first_at_us) / 1000 if first_at_us else 0,
        }

    async def cancel_once(self, length: int) -> dict:
        """Barge in on a long incremental answer right after its first audio: how long until the
        last audio arrives, and how many frames of the turn arrive after the cancel."""
        from voicebus.agents.sdk import Publisher
        from voicebus.players.listener import Listener

        lane = self.stack.lanes["incremental"].settings
        sid, tid = f"cancel-{uuid.uuid4().hex[:8]}", "t1"
        text = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(length))
        page, page_out = None, {}
        async with Listener(self.stack.edge_url, sid, lane.edge_secret) as listener:
            try:
                if self.browser is not None:
                    page = await self.browser.open(self.stack.edge_url, sid, lane.edge_secret)
                async with Publisher(lane, agent_id="bench") as publisher:
                    speaking = asyncio.create_task(self._speak(publisher, sid, tid, text))
                    turn = await listener.wait_first_audio(tid, 300)
                    if page is not None:  # barge in while the page is playing
                        audible = await self._report(sid, tid, PlaybackKind.AUDIBLE_START, AUDIBLE_TIMEOUT_S)
                        page_out["page_audible_before_cancel"] = audible is not None
                    sent_at = now_us()
                    await listener.cancel(tid, reason="bench: barge-in")
                    if page is not None:
                        page_out |= await self._page_silence(page, sid, tid, sent_at)
                    await speaking
                    await asyncio.sleep(2.0)  # anything still coming would arrive in this window
                if page is not None:  # and it stayed silent through that window
                    stats = await page.evaluate("window.voicebusPlayer.stats")
                    page_out["page_loud_quanta_after_stop"] = stats.get("loudQuantaSinceStop")
                    page_out["page_quanta_after_stop"] = stats.get("quantaSinceStop")
            finally:
                if page is not None:
                    await self.browser.close_pages([page])
        worker = self.stack.lanes["incremental"].worker
        seen = [o for o in worker.cancel_log if o.session_id == sid]
        last_rx = turn.last_audio_at_us or sent_at
        return page_out | {
            "cancel_to_last_audio_received_ms": max(0, last_rx - sent_at) / 1000,
            # already on the wire when the cancel left: the listener discards them, as a player does
            "frames_in_flight_at_cancel": len(turn.discarded) - turn.frames_after_stop,
            "frames_after_stop": turn.frames_after_stop,  # the edge promises none
            "worker_cancel_to_last_chunk_published_ms": seen[0].cancel_to_last_chunk_ms if seen else None,
            "worker_saw_cancel_after_ms": (seen[0].seen_at_us - sent_at) / 1000 if seen else None,
            "stopped_by_edge": turn.stopped,
        }

    async def _page_silence(self, page, session_id: str, turn_id: str, sent_at_us: int) -> dict:
        """After a cancel: when the page's worklet rendered silence. The worklet applies "stop"
        between render quanta and reports the frame it stopped at; the page maps that frame to
        the server clock (the same mapping as its audible start) and sends a STOPPED report."""
        stopped = await self._report(session_id, turn_id, PlaybackKind.STOPPED, 10.0)
        out: dict = {"cancel_to_page_silence_ms": (stopped.audible_at_us - sent_at_us) / 1000 if stopped else None}
        try:  # 40 render quanta (~210 ms) after the stop: nothing may have been rendered loud
            await page.wait_for_function("window.voicebusPlayer.stats.stops >= 1 && "
                                         "window.voicebusPlayer.stats.quantaSinceStop >= 40", timeout=10000)
            out["page_silent_quanta_checked"] = True
        except Exception:  # noqa: BLE001 - reported, not fatal for the bench
            out["page_silent_quanta_checked"] = False
        return out


def _confirming_token_wait_ms(timeline: dict, produced_us: list[int]) -> float:
    """From the arrival of the first audio's sentence's last character at the gate to the
    production of the next token (none: the end of the turn confirmed it, counted as 0). A
    sentence the gate released before that token (speculative release: tentative, confirmed
    later) did not wait for it: 0."""
    complete = timeline.get("text_complete_at_us", 0)
    later = [p for p in produced_us if p > complete]
    if not later:
        return 0.0
    released = timeline.get("released_at_us")
    if released is not None and released < later[0]:
        return 0.0
    return (later[0] - complete) / 1000


def summarise(samples: list[dict], conc: list[dict], cancels: list[dict], meta: dict) -> dict:
    out: dict = {"meta": meta}
    browser = any("audible_ms" in s for s in samples + conc) or bool(meta.get("browser"))
    for mode in ("incremental", "buffered"):
        mine = [s for s in samples if s["mode"] == mode]
        out[mode] = {
            "ttfa_ms": summary(s["ttfa_ms"] for s in mine),
            "overhead_ms": summary(s["overhead_ms"] for s in mine),
            "model_ttfa_ms": summary(s["model_ttfa_ms"] for s in mine),
            "by_length": {
                str(n): {
                    "ttfa_ms": summary(s["ttfa_ms"] for s in mine if s["sentences"] == n),
                    "stages_p50_ms": {st: statistics.median(s["stages"][st] for s in mine if s["sentences"] == n and st in s["stages"])
                                      for st in STAGE_ORDER if any(st in s["stages"] for s in mine if s["sentences"] == n)},
                }
                for n in sorted({s["sentences"] for s in mine})
            },
            "by_concurrency": {
                str(n): {
                    "ttfa_ms": summary(s["ttfa_ms"] for s in conc if s["mode"] == mode and s["sessions"] == n),
                    "starvation_ms": summary(s["starvation_ms"] for s in conc if s["mode"] == mode and s["sessions"] == n),
                    "starvation_gaps": summary(s["starvation_gaps"] for s in conc if s["mode"] == mode and s["sessions"] == n),
                }
                for n in sorted({s["sessions"] for s in conc if s["mode"] == mode})
            },
        }
        if browser:
            out[mode]["audible_ms"] = _audible(mine)
            for n, row in out[mode]["by_length"].items():
                row["audible_ms"] = _audible(s for s in mine if s["sentences"] == int(n))
            for n, row in out[mode]["by_concurrency"].items():
                row["audible_ms"] = _audible(s for s in conc if s["mode"] == mode and s["sessions"] == int(n))
    inc, buf = out["incremental"]["ttfa_ms"]["p50"], out["buffered"]["ttfa_ms"]["p50"]
    out["ratio_p50"] = buf / inc if inc else float("nan")
    out["ratio_p50_by_length"] = {
        n: out["buffered"]["by_length"][n]["ttfa_ms"]["p50"] / out["incremental"]["by_length"][n]["ttfa_ms"]["p50"]
        for n in out["incremental"]["by_length"] if n in out["buffered"]["by_length"]
    }
    if browser:
        inc, buf = out["incremental"]["audible_ms"]["p50"], out["buffered"]["audible_ms"]["p50"]
        out["ratio_audible_p50"] = buf / inc if inc else float("nan")
        out["ratio_audible_p50_by_length"] = {
            n: _ratio(out["buffered"]["by_length"][n]["audible_ms"]["p50"], out["incremental"]["by_length"][n]["audible_ms"]["p50"])
            for n in out["incremental"]["by_length"] if n in out["buffered"]["by_length"]
        }
    # what the bus, gate and edge add, measured on the incremental hand-off
    inc = [s for s in samples if s["mode"] == "incremental"]
    out["overhead_ms"] = {k: out["incremental"]["overhead_ms"][k] for k in ("p50", "p95", "n")}
    out["confirming_token_wait_ms"] = summary(s.get("confirming_token_wait_ms", 0.0) for s in inc)
    out["overhead_beyond_confirming_token_ms"] = summary(
        s["overhead_ms"] - s.get("confirming_token_wait_ms", 0.0) for s in inc)
    out["cancel"] = {
        "cancel_to_last_audio_received_ms": summary(c["cancel_to_last_audio_received_ms"] for c in cancels),
        "frames_in_flight_at_cancel_total": sum(c["frames_in_flight_at_cancel"] for c in cancels),
        "frames_after_stop_total": sum(c["frames_after_stop"] for c in cancels),
        "worker_cancel_to_last_chunk_published_ms": summary(
            c["worker_cancel_to_last_chunk_published_ms"] for c in cancels if c["worker_cancel_to_last_chunk_published_ms"] is not None),
        "runs": cancels,
    }
    if browser:
        silence = [c["cancel_to_page_silence_ms"] for c in cancels if c.get("cancel_to_page_silence_ms") is not None]
        out["cancel"] |= {
            "cancel_to_page_silence_ms": summary(silence),
            "page_silence_reported": f"{len(silence)}/{len(cancels)}",
            "page_loud_quanta_after_stop_total": sum(c.get("page_loud_quanta_after_stop") or 0 for c in cancels),
        }
    traced = [s for s in samples if s["mode"] == "traced"]
    if traced:
        out["traced"] = {"ttfa_ms": summary(s["ttfa_ms"] for s in traced),
                         "overhead_ms": summary(s["overhead_ms"] for s in traced)}
        out["tracing_delta_ms"] = {
            "ttfa_p50": out["traced"]["ttfa_ms"]["p50"] - out["incremental"]["ttfa_ms"]["p50"],
            "overhead_p50": out["traced"]["overhead_ms"]["p50"] - out["incremental"]["overhead_ms"]["p50"],
        }
        # Paired: the k-th traced and the k-th untraced single-session turn are the same run and
        # answer length, taken back to back, so the machine's drifting load falls on both alike.
        single = [s for s in samples if s["mode"] == "incremental"]
        diffs = [t["overhead_ms"] - i["overhead_ms"] for i, t in zip(single, traced)]
        if diffs:
            lo, hi = bootstrap_median_ci(diffs)
            out["tracing_delta_ms"]["paired_overhead"] = {**summary(diffs), "ci95_p50": [lo, hi]}
    out["samples"] = samples + conc
    return out


def bootstrap_median_ci(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median of `values` (seeded: reproducible)."""
    import random

    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _audible(samples) -> dict:
    return summary(s["audible_ms"] for s in samples if s.get("audible_ms") is not None)


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def markdown_table(results: dict) -> str:
    meta = results["meta"]
    browser = "ratio_audible_p50" in results
    stages = [s for s in STAGE_ORDER if s != "audible" or browser]
    lines = [
        f"Engine {meta['engine']} on {meta['device']}, LLM tokens every {meta['token_ms']:g} ms, "
        f"{meta['runs']} runs per cell, modes alternated (A/B in one run)."
        + (" A web player in headless chromium was attached to every measured session." if browser else ""),
        "",
        "| answer | incremental TTFA p50 / p95 (ms) | buffered TTFA p50 / p95 (ms) | buffered / incremental (p50) |",
        "|---|---|---|---|",
    ]
    for n, ratio in results["ratio_p50_by_length"].items():
        i, b = results["incremental"]["by_length"][n]["ttfa_ms"], results["buffered"]["by_length"][n]["ttfa_ms"]
        lines.append(f"| {n} sentence(s) | {i['p50']:.0f} / {i['p95']:.0f} | {b['p50']:.0f} / {b['p95']:.0f} | {ratio:.2f}x |")
    i, b = results["incremental"]["ttfa_ms"], results["buffered"]["ttfa_ms"]
    lines.append(f"| **all** | **{i['p50']:.0f}** / {i['p95']:.0f} | **{b['p50']:.0f}** / {b['p95']:.0f} | **{results['ratio_p50']:.2f}x** |")
    if browser:
        lines += ["", "Time to audible start in the browser (first token -> first non-silent sample rendered by the page):", "",
                  "| answer | incremental audible p50 / p95 (ms) | buffered audible p50 / p95 (ms) | buffered / incremental (p50) |",
                  "|---|---|---|---|"]
        for n, ratio in results["ratio_audible_p50_by_length"].items():
            i, b = results["incremental"]["by_length"][n]["audible_ms"], results["buffered"]["by_length"][n]["audible_ms"]
            lines.append(f"| {n} sentence(s) | {i['p50']:.0f} / {i['p95']:.0f} | {b['p50']:.0f} / {b['p95']:.0f} | {ratio:.2f}x |")
        i, b = results["incremental"]["audible_ms"], results["buffered"]["audible_ms"]
        lines.append(f"| **all** | **{i['p50']:.0f}** / {i['p95']:.0f} | **{b['p50']:.0f}** / {b['p95']:.0f} "
                     f"| **{results['ratio_audible_p50']:.2f}x** |")
    o = results["overhead_ms"]
    lines += ["", f"Overhead of bus + gate + edge (incremental TTFA - wait for the first sentence's text - model's own "
                  f"time to first audio): p50 {o['p50']:.1f} ms, p95 {o['p95']:.1f} ms."]
    if "overhead_beyond_confirming_token_ms" in results:
        w, b = results["confirming_token_wait_ms"], results["overhead_beyond_confirming_token_ms"]
        lines += [f"Of that, waiting for the next token that makes the sentence's end certain: p50 {w['p50']:.1f} ms; "
                  f"the rest (gate, bus hops, worker queue, edge): p50 {b['p50']:.1f} ms, p95 {b['p95']:.1f} ms."]
    lines += ["",
              "Per-stage p50 of the first audio, ms after the first token (incremental):", "",
              "| answer | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    for n, row in results["incremental"]["by_length"].items():
        lines.append(f"| {n} | " + " | ".join(f"{row['stages_p50_ms'].get(s, float('nan')):.0f}" for s in stages) + " |")
    lines += ["", "Concurrency (4-sentence answers, full playback):", "",
              "| sessions | incremental TTFA p50 / p95 | buffered TTFA p50 / p95 | incremental starvation p50 (ms) | buffered starvation p50 (ms) |",
              "|---|---|---|---|---|"]
    for n, row in results["incremental"]["by_concurrency"].items():
        b = results["buffered"]["by_concurrency"].get(n)
        if not b:
            continue
        lines.append(f"| {n} | {row['ttfa_ms']['p50']:.0f} / {row['ttfa_ms']['p95']:.0f} | {b['ttfa_ms']['p50']:.0f} / {b['ttfa_ms']['p95']:.0f} "
                     f"| {row['starvation_ms']['p50']:.0f} | {b['starvation_ms']['p50']:.0f} |")
    c = results["cancel"]
    lines += ["", f"Cancel (barge-in after the first audio of a 7-sentence answer, {len(c['runs'])} runs): last audio received "
                  f"p50 {c['cancel_to_last_audio_received_ms']['p50']:.0f} ms after the cancel was sent; frames of the cancelled "
                  f"turn already in flight when the cancel left (discarded by the player): {c['frames_in_flight_at_cancel_total']}; "
                  f"sent after the edge's stop: {c['frames_after_stop_total']}; worker: cancel seen -> last chunk published "
                  f"p50 {c['worker_cancel_to_last_chunk_published_ms']['p50']:.0f} ms.", ""]
    if "tracing_delta_ms" in results:
        t, i, d = results["traced"], results["incremental"], results["tracing_delta_ms"]
        lines[-1:] = [(f"Tracing A/B (single-session turns, untraced incremental lane vs the same lane traced, spans exported "
                       f"nowhere; n = {i['ttfa_ms']['n']} / {t['ttfa_ms']['n']}): TTFA p50 {i['ttfa_ms']['p50']:.1f} vs "
                       f"{t['ttfa_ms']['p50']:.1f} ms ({d['ttfa_p50']:+.1f} ms); overhead p50 {i['overhead_ms']['p50']:.1f} vs "
                       f"{t['overhead_ms']['p50']:.1f} ms ({d['overhead_p50']:+.1f} ms)."
                       + (f" Paired (each traced turn minus the untraced one of the same run and length): overhead "
                          f"difference p50 {d['paired_overhead']['p50']:+.1f} ms, 95 % CI "
                          f"[{d['paired_overhead']['ci95_p50'][0]:+.1f}, {d['paired_overhead']['ci95_p50'][1]:+.1f}] ms."
                          if "paired_overhead" in d else "")
                       + (f" The tracing calls on one sentence's first-audio path cost p50 "
                          f"{results['tracing_path_cost_us']['p50']:.0f} µs, p95 {results['tracing_path_cost_us']['p95']:.0f} µs "
                          f"in-process, CPU time p50 {results['tracing_path_cpu_us']['p50']:.0f} µs "
                          f"(tracing off, the same calls on the no-op tracer: p50 "
                          f"{results['tracing_off_path_cost_us']['p50']:.1f} µs)." if "tracing_path_cost_us" in results else "")), ""]
    if "cancel_to_page_silence_ms" in c:
        sil = c["cancel_to_page_silence_ms"]
        lines[-1:] = [(f"In the browser (barge-in once the page was audible): cancel sent -> the page's worklet renders "
                       f"silence p50 {sil['p50']:.0f} ms, p95 {sil['p95']:.0f} ms ({c['page_silence_reported']} runs reported); "
                       f"loud render quanta after the stop: {c['page_loud_quanta_after_stop_total']}."), ""]
    if "oneshot" in results:
        lines.append(oneshot_bench.markdown(results["oneshot"]))
    return "\n".join(lines)


def print_results(results: dict) -> None:
    print(markdown_table(results))
    keys = ("ratio_p50", "overhead_ms") + (("ratio_audible_p50",) if "ratio_audible_p50" in results else ()) + tuple(
        k for k in ("tracing_delta_ms", "tracing_path_cost_us", "tracing_path_cpu_us", "tracing_off_path_cost_us")
        if k in results)
    if "oneshot" in results:
        keys += ("oneshot",)
    print(json.dumps({k: results[k] for k in keys if k != "oneshot"}
                     | ({"oneshot": {k: v for k, v in results["oneshot"].items() if k != "samples"}}
                        if "oneshot" in results else {})
                     | {m: {k: results[m][k] for k in ("ttfa_ms", "audible_ms") if k in results[m]}
                        for m in ("incremental", "buffered")}))


def write_chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(results["ratio_p50_by_length"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    xs = range(len(lengths))
    for offset, mode, color in ((-width / 2, "incremental", "#2a9d8f"), (width / 2, "buffered", "#e76f51")):
        p50 = [results[mode]["by_length"][n]["ttfa_ms"]["p50"] for n in lengths]
        p95 = [results[mode]["by_length"][n]["ttfa_ms"]["p95"] for n in lengths]
        ax1.bar([x + offset for x in xs], p50, width, label=f"{mode} p50", color=color)
        ax1.errorbar([x + offset for x in xs], p50, yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p95)]],
                     fmt="none", ecolor="black", capsize=3)
    ax1.set_xticks(list(xs), [f"{n} sentence(s)" for n in lengths])
    ax1.set_ylabel("time to first audio (ms)")
    ax1.set_title("first token -> first audio at the edge client")
    ax1.legend()
    conc = list(results["incremental"]["by_concurrency"])
    for mode, color in (("incremental", "#2a9d8f"), ("buffered", "#e76f51")):
        ax2.plot([int(n) for n in conc], [results[mode]["by_concurrency"].get(n, {}).get("ttfa_ms", {}).get("p50", float("nan")) for n in conc],
                 marker="o", label=mode, color=color)
    ax2.set_xlabel("sessions at once (4-sentence answers)")
    ax2.set_ylabel("time to first audio p50 (ms)")
    ax2.set_title("concurrency")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
