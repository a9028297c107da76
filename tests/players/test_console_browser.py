"""The demo console, as a person uses it: `voicebus demo --console` (tiny model) prints one URL;
Debian's headless chromium opens it, compares buffered and incremental hand-off on a shipped
multi-sentence conversation, then barges in on a long answer. One pipeline for the whole test.

With ``--update-screenshots`` it also writes the README's screenshot (docs/img/console.png)
from the real page."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from voicebus.gate.segmenter import StreamingSegmenter
from tests.players.test_browser_e2e import CHROMIUM, CHROMIUM_ARGS
from tests.players.test_edge_kafka import read_topic
from tests.waiting import eventually, eventually_sync

pytestmark = [pytest.mark.kafka, pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[2]
URL_LINE = re.compile(r"^http://127\.0\.0\.1:\d+/console#k=[A-Za-z0-9_-]+$")


class Demo:
    """`voicebus demo --console --tiny` as a child process; its output collected line by line."""

    def __init__(self, settings, columns: int = 80) -> None:
        env = {**os.environ, **settings.to_env(), "COLUMNS": str(columns), "PYTHONPATH": str(ROOT),
               "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voicebus", "demo", "--console", "--tiny", "--conversations",
             "support,markdown_long"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True, name="demo-out").start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def url(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError("the demo exited:\n" + "\n".join(self.lines[-40:]))
        return next((line for line in self.lines if "/console#k=" in line), None)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # what a person does: Ctrl-C
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def sentences_of(text: str) -> int:
    segmenter = StreamingSegmenter("en")
    return len(segmenter.feed(text) + segmenter.flush())


async def wait_in_page(page, expression: str, timeout_s: float, what: str):
    await eventually(lambda: page.evaluate(expression), timeout_s=timeout_s, interval_s=0.25, what=what)
    return await page.evaluate(expression)


async def dump(page, demo: Demo) -> None:
    """What the page and the demo said, printed for a failing run (pytest shows it)."""
    print("\n".join(demo.lines[-40:]))
    if page is not None:
        print(await page.evaluate("""(() => { const c = window.voicebusConsole; return JSON.stringify({
            status: document.getElementById('status').textContent, state: c.state, busy: c.busy, results: c.results,
            errors: c.errors, stats: c.stats, plays: c.plays.map(p => ({mode: p.mode, ids: p.turnIds, done: p.done})),
            turns: [...c.turns.values()].map(t => ({id: t.turnId, mode: t.mode, done: t.done, ended: t.ended,
                audible: t.audibleAtUs, samples: t.samples, first_token: t.firstTokenAtUs,
                sentences: [...t.sentences.values()].map(x => ({seq: x.seq, audible: x.audibleAtUs,
                    timeline: x.timeline}))}))}); })()"""))


TURNS = """(mode) => [...window.voicebusConsole.turns.values()].filter(t => t.mode === mode).map(t => ({
    turnId: t.turnId, ttfaMs: t.ttfaMs, audibleAtUs: t.audibleAtUs, samples: t.samples, done: t.done,
    bargedAtUs: t.bargedAtUs, lateSentences: t.lateSentences, firstTokenAtUs: t.firstTokenAtUs,
    sentences: [...t.sentences.values()].map(s => ({seq: s.seq, samples: s.samples, audibleAtUs: s.audibleAtUs,
        synth: s.timeline && s.timeline.synthesis_started_at_us}))}))"""


async def test_console_compares_buffered_and_incremental_and_barges_in(make_settings, screenshot_path):
    from playwright.async_api import async_playwright

    # Port 0: the edge binds a free port when it starts and the demo prints that one (a port picked
    # here could be taken by an outgoing connection during the minute the pipeline takes to start).
    # Speed 4 (the gate's default_speed, the contract's maximum): the tiny model's random durations
    # give ~28 s of noise for this answer at speed 1; a quarter of that keeps the test light on a
    # small, busy CPU. Everything else is as a person runs it.
    settings = make_settings(edge_port=0, edge_secret="console-test-secret", worker_max_in_flight=2, default_speed=4.0)
    demo = Demo(settings)
    try:
        url = eventually_sync(demo.url, timeout_s=240, interval_s=0.2, what="the console URL printed by the demo")
        # One unbroken line at 80 columns: nothing else on it, short enough that no terminal wraps it.
        assert URL_LINE.match(url), url
        assert len(url) <= 80, (len(url), url)
        assert demo.lines[demo.lines.index(url) - 1] == "" and "Ctrl-C" in "\n".join(demo.lines)

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = None
            try:
                page = await browser.new_page(viewport={"width": 1200, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(url)
                await wait_in_page(page, "window.voicebusConsole.state === 'idle'", 30, "the console got a session")
                await page.select_option("#source", "support")

                # --- compare: the same 4-sentence answer, buffered then incremental -----------
                await page.click("#compare")
                results = await wait_in_page(
                    page, "(() => { const r = window.voicebusConsole.results; return r.buffered !== null && "
                          "r.incremental !== null && !window.voicebusConsole.busy && r; })()",
                    480, "both times to first audible sound")
                buffered, incremental = await page.evaluate(TURNS, "buffered"), await page.evaluate(TURNS, "incremental")
                assert len(buffered) == 1 and len(incremental) == 1, (buffered, incremental)
                for turn in buffered + incremental:  # audible: the worklet rendered non-silent samples
                    assert turn["audibleAtUs"] and turn["samples"] > 24000 * 0.3, turn
                assert results["buffered"] > results["incremental"] > 0, results
                shown = {m: await page.text_content(f"#ttfa-{m}") for m in ("buffered", "incremental")}
                for mode, text in shown.items():
                    assert text.endswith(" ms") and abs(int(text[:-3]) - results[mode]) <= 1, (shown, results)

                # A waterfall row per sentence the gate released (read back from its synthesis topic).
                requests = await read_topic(settings, settings.synthesis_topic, "SynthesisRequest",
                                            lambda v: any(r["is_last_in_turn"] for r in v), timeout=30)
                released = [r for r in requests if r["turn_id"] == incremental[0]["turnId"] and r["text"].strip()]
                assert len(released) >= 3, released  # a multi-sentence answer
                rows = await page.eval_on_selector_all(
                    f".turn[data-turn-id='{incremental[0]['turnId']}'] tr.sentence", "rs => rs.map(r => r.dataset.sentence)")
                assert rows == [str(r["sentence_seq"]) for r in released], (rows, released)
                cells = await page.eval_on_selector_all(
                    f".turn[data-turn-id='{incremental[0]['turnId']}'] tr.sentence:first-child td",
                    "cs => cs.map(c => c.textContent)")
                assert all(cells[1:7]), cells  # tokens done, released, synth start, first chunk, sent, audible
                rows_buffered = await page.eval_on_selector_all(
                    f".turn[data-turn-id='{buffered[0]['turnId']}'] tr.sentence", "rs => rs.length")
                assert rows_buffered == 1  # buffered: the whole answer is one request
                await page.screenshot(path=str(screenshot_path("console.png")), full_page=True)

                # --- barge in on a long answer: the rest is never synthesized ------------------
                await page.select_option("#source", "markdown_long")
                await page.check("input[name=mode][value=incremental]")
                await page.click("#play")
                turn_id = await wait_in_page(page, "window.voicebusConsole.plays.length === 3 && "
                                                   "window.voicebusConsole.plays[2].turnIds[0]", 30, "the long answer's play")
                await wait_in_page(page, f"[...window.voicebusConsole.turns.values()].some(t => t.turnId === '{turn_id}' "
                                         "&& t.audibleAtUs)", 120, "the long answer is audible")
                await page.click("#bargein")
                await wait_in_page(page, "!window.voicebusConsole.busy", 30, "the play ends after the barge-in")
                control = await read_topic(settings, settings.control_topic, "ControlEvent",
                                           lambda v: any(c["turn_id"] == turn_id for c in v))
                cancel_at = next(c["issued_at_us"] for c in control if c["turn_id"] == turn_id)
                # Anything still in the pipeline would reach the page well within this; the page
                # counts a row whose synthesis started after the barge-in as "late".
                note = await wait_in_page(
                    page, f"(() => {{ const n = document.querySelector(\".turn[data-turn-id='{turn_id}'] .note\"); "
                          "return n && n.textContent; })()", 10, "the barge-in note")
                assert "never was" in note, note
                audio = await read_topic(settings, settings.audio_topic, "AudioChunk",
                                         lambda v: any(a["turn_id"] == turn_id for a in v), timeout=10)
                chunks = [a for a in audio if a["turn_id"] == turn_id]
                total = sentences_of(next(c["turns"][0]["text"] for c in await page.evaluate(
                    "window.voicebusConsole.conversations") if c["name"] == "markdown_long"))
                synthesized = {a["sentence_seq"] for a in chunks}
                assert len(synthesized) < total, (synthesized, total)
                # The agent stopped when the page barged in: what it had not said by then (nothing, when
                # the first sound came after its last token on a slow machine) is shown as never said.
                assert await page.eval_on_selector_all("#spoken .pending", "ts => ts.length") == 0
                assert all(a["synthesis_started_at_us"] <= cancel_at + 50_000 for a in chunks), \
                    "a sentence was synthesized after the barge-in"
                state = (await page.evaluate(TURNS, "incremental"))
                assert next(t for t in state if t["turnId"] == turn_id)["lateSentences"] == 0
                stats = await page.evaluate("window.voicebusConsole.stats")
                assert stats["stops"] >= 1 and stats["loudQuantaSinceStop"] == 0, stats
                assert not errors and not await page.evaluate("window.voicebusConsole.errors"), errors
            except BaseException:
                await dump(page, demo)
                raise
            finally:
                await browser.close()
    finally:
        rc = demo.stop()
    assert rc == 0, "\n".join(demo.lines[-40:])
    assert any("pipeline stopped" in line for line in demo.lines[-10:]), demo.lines[-10:]
