"""End to end in Debian's headless chromium: a turn published on Kafka plays in the web player,
its audible start comes back as a PlaybackReport on the bus, and barge-in silences it."""

import time

import pytest

from voicebus.bus import make_producer, publish
from voicebus.codecs import Codec
from voicebus.players.auth import issue_token, player_url
from voicebus.players.tone import tone_turn
from voicebus.schemas.contract import AudioEncoding
from tests.players.edge_helpers import SECRET, publish_audio, running_edge
from tests.players.test_edge_kafka import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ("--headless --no-sandbox --disable-gpu --autoplay-policy=no-user-gesture-required "
                 "--disable-background-networking --disable-component-update --disable-sync --no-first-run").split()
LEADING_SILENCE_S = 0.2


async def wait_in_page(page, expression: str, timeout_ms: int = 15000):
    await page.wait_for_function(expression, timeout=timeout_ms)
    return await page.evaluate(expression)


async def test_a_turn_from_kafka_plays_reports_audible_start_and_barge_in_silences_it(make_settings):
    from playwright.async_api import async_playwright

    settings = make_settings(edge_secret=SECRET)
    async with running_edge(settings) as (app, client), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # the token rides in the fragment (never sent to the server); the page reads location.hash
            url = player_url(str(client.make_url("/")), "S", issue_token(SECRET, "S", 300))
            assert "#session=S&token=" in url
            await page.goto(url)
            await page.click("#start")
            await wait_in_page(page, "window.voicebusPlayer.state === 'ready' && window.voicebusPlayer.clock.samples >= 3")

            # 3 sentences x 10 chunks x 150 ms = 4.5 s of tone, after 200 ms of silence.
            chunks = tone_turn("S", "turn-1", sentences=3, chunks_per_sentence=10, leading_silence_s=LEADING_SILENCE_S)
            await publish_audio(settings, chunks)

            reports = await read_topic(settings, settings.playback_topic, "PlaybackReport",
                                       lambda v: any(r["kind"] == "AUDIBLE_START" for r in v))
            audible = next(r for r in reports if r["kind"] == "AUDIBLE_START")
            assert audible["session_id"] == "S" and audible["turn_id"] == "turn-1" and audible["sentence_seq"] == 0
            sent_at_us = await page.evaluate("window.voicebusPlayer.turns.get(1).timeline.sent_at_us")
            # The first non-silent sample is rendered after the leading silence (plus the jitter
            # buffer and output latency) following the moment the edge sent the first frame.
            delay_s = (audible["audible_at_us"] - sent_at_us) / 1e6
            assert LEADING_SILENCE_S - 0.02 < delay_s < 2.0, delay_s
            print(f"audible start {delay_s * 1e3:.1f} ms after the edge sent the first frame "
                  f"({LEADING_SILENCE_S * 1e3:.0f} ms of it leading silence)")
            assert audible["reported_at_us"] >= audible["audible_at_us"] - 500_000

            await wait_in_page(page, "window.voicebusPlayer.stats.peak > 0.1")  # it is playing now
            row = await page.eval_on_selector_all("#timeline tbody tr td", "cells => cells.map(c => c.textContent)")
            assert row[0] == "1: turn-1" and all(row[1:7]), row  # token .. audible, all filled in
            assert float(row[6]) > float(row[5]) > 0  # audible after sent, in ms from the first token
            lit = await page.evaluate("""(() => { const c = document.getElementById('wave');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 1; i < d.length; i += 4) if (d[i] > 100) n++; return n; })()""")
            assert lit > 100  # the live waveform drew the tone
            await page.click("#bargein")
            stats = await wait_in_page(page, "window.voicebusPlayer.stats.stops >= 1 && "
                                             "window.voicebusPlayer.stats.quantaSinceStop >= 40 && window.voicebusPlayer.stats")
            assert stats["loudQuantaSinceStop"] == 0 and stats["peak"] == 0, stats  # silent from the next quantum
            events = await read_topic(settings, settings.control_topic, "ControlEvent", lambda v: v)
            assert events[0]["session_id"] == "S" and events[0]["turn_id"] == "turn-1"
            # and stays silent over the next 112 rendered quanta of 128 frames (about 0.3 s of audio)
            later = stats["quantaSinceStop"] + 112
            stats = await wait_in_page(page, f"window.voicebusPlayer.stats.quantaSinceStop >= {later} && "
                                             "window.voicebusPlayer.stats")
            assert stats["loudQuantaSinceStop"] == 0 and stats["peak"] == 0, stats
            assert not errors and not await page.evaluate("window.voicebusPlayer.errors")
        finally:
            await browser.close()


async def test_an_opus_turn_is_decoded_with_webcodecs_and_plays_to_its_end(make_settings):
    """Opus frames (encoding byte 2) are decoded by WebCodecs' AudioDecoder and played through the
    worklet: the turn becomes audible after its leading silence and ends, both reported on the bus."""
    from playwright.async_api import async_playwright

    settings = make_settings(edge_secret=SECRET, audio_encoding="opus")
    async with running_edge(settings) as (app, client), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(player_url(str(client.make_url("/")), "S", issue_token(SECRET, "S", 300)))
            await page.click("#start")
            await wait_in_page(page, "window.voicebusPlayer.state === 'ready' && window.voicebusPlayer.clock.samples >= 3")

            # 2 sentences x 5 chunks x 160 ms (whole 20 ms frames) = 1.6 s of tone after 200 ms of silence
            chunks = tone_turn("S", "turn-1", sentences=2, chunks_per_sentence=5, leading_silence_s=LEADING_SILENCE_S,
                               encoding=AudioEncoding.OPUS)
            await publish_audio(settings, chunks)
            peak = await wait_in_page(page, "window.voicebusPlayer.stats.peak > 0.2 && window.voicebusPlayer.stats.peak")
            assert peak < 0.4, peak  # the 0.3 tone, decoded

            reports = await read_topic(settings, settings.playback_topic, "PlaybackReport",
                                       lambda v: any(r["kind"] == "PLAYBACK_END" for r in v))
            kinds = [r["kind"] for r in reports]
            assert kinds[0] == "AUDIBLE_START" and "PLAYBACK_END" in kinds and "UNDERRUN" not in kinds, kinds
            audible = reports[0]
            end = next(r for r in reports if r["kind"] == "PLAYBACK_END")
            sent_at_us = await page.evaluate("window.voicebusPlayer.turns.get(1).timeline.sent_at_us")
            assert LEADING_SILENCE_S - 0.02 < (audible["audible_at_us"] - sent_at_us) / 1e6 < 2.0
            # the whole tone was played: 1.6 s from audible start to end (+ the codec's few ms)
            played_s = (end["audible_at_us"] - audible["audible_at_us"]) / 1e6
            assert 1.55 < played_s < 1.75, played_s
            assert await page.evaluate("window.voicebusPlayer.framesReceived") == len(chunks)
            assert not errors and not await page.evaluate("window.voicebusPlayer.errors")
        finally:
            await browser.close()


async def test_an_opus_turn_resumes_on_another_edge_at_the_sentence_being_played_after_its_edge_is_killed(
        make_settings, tmp_path):
    """Two `voicebus edge` processes share the audio topic. The page plays an Opus turn from edge A,
    which owns its session; A is SIGKILLed mid-turn (the player has 10 of its 12 sentences). The player reconnects to B (the other edge its
    ready listed; B redirects it to A until the group gives B A's partitions), resumes with the
    sentence it was playing, B re-reads that sentence from the partition and sends the turn from its
    start, the player keeps only what it lacked, and B streams the sentences published after the kill.
    The turn plays to its end."""
    from playwright.async_api import async_playwright

    from voicebus.bus import ensure_topics
    from tests.players.shard_helpers import EdgeProcess, free_ports, session_on, wait_processes_settled

    partitions, per_sentence = 4, 8
    port_a, port_b = free_ports(2)
    # Two edges on two origins (ports): the player follows only origins it is told to trust.
    settings = make_settings(edge_secret=SECRET, audio_encoding="opus", partitions=partitions,
                             edge_session_timeout_ms=6000,
                             edge_redirect_origins=f"http://127.0.0.1:{port_a},http://127.0.0.1:{port_b}")
    await ensure_topics(settings, [settings.audio_topic, settings.control_topic])
    edge_a = EdgeProcess(settings, port_a, "edge-a", tmp_path / "edge-a.log")
    edge_b = EdgeProcess(settings, port_b, "edge-b", tmp_path / "edge-b.log")
    edges = [edge_a, edge_b]
    try:
        owned = await wait_processes_settled([edge_a, edge_b], partitions)
        session = session_on(partitions, owned["edge-a"])
        # 12 sentences x 8 chunks x 160 ms (15.4 s): 10 published before the kill (more than the
        # failover takes to play), 2 after it
        chunks = tone_turn(session, "turn-1", sentences=12, chunks_per_sentence=per_sentence,
                           leading_silence_s=LEADING_SILENCE_S, encoding=AudioEncoding.OPUS)
        before, after = chunks[:10 * per_sentence], chunks[10 * per_sentence:]
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page()
                errors = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(player_url(edge_a.url + "/", session, issue_token(SECRET, session, 300)))
                await page.click("#start")
                await wait_in_page(page, "window.voicebusPlayer.state === 'ready' && window.voicebusPlayer.clock.samples >= 3")
                assert await page.evaluate("window.voicebusPlayer.edge") == "edge-a"
                producer, codec = make_producer(settings), Codec()
                await producer.start()
                try:
                    for chunk in before:
                        await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
                    await wait_in_page(page, f"window.voicebusPlayer.framesReceived === {len(before)} && "
                                             "window.voicebusPlayer.current && window.voicebusPlayer.current.sentence >= 1")
                    edge_a.kill()  # SIGKILL: no goodbye, no LeaveGroup; B gets A's partitions one session timeout later
                    killed_at = time.monotonic()
                    for chunk in after:
                        await publish(producer, codec, settings.audio_topic, "AudioChunk", chunk)
                finally:
                    await producer.stop()
                await wait_in_page(page, "window.voicebusPlayer.edge === 'edge-b' && window.voicebusPlayer.state === 'ready'",
                                   timeout_ms=60000)
                failover_s = time.monotonic() - killed_at
                hello = await page.evaluate("window.voicebusPlayer.lastHello")
                assert hello["resume"]["turn_id"] == "turn-1", hello
                resumed_at = hello["resume"]["sentence_seq"]
                assert 1 <= resumed_at <= 9, hello  # the sentence being played when it said hello to B
                await wait_in_page(page, f"window.voicebusPlayer.framesReceived === {len(chunks)}", timeout_ms=30000)
                # B sent the turn again from the start of the sentence being played: the player had
                # those frames (A sent them before it died) and dropped exactly them
                assert await page.evaluate("window.voicebusPlayer.duplicates") == (10 - resumed_at) * per_sentence
                reports = await read_topic(settings, settings.playback_topic, "PlaybackReport",
                                           lambda v: any(r["kind"] == "PLAYBACK_END" for r in v), timeout=60)
                end = next(r for r in reports if r["kind"] == "PLAYBACK_END")
                assert end["turn_id"] == "turn-1" and end["session_id"] == session
                connections = await page.evaluate("window.voicebusPlayer.edges.connections")
                underruns = [r for r in reports if r["kind"] == "UNDERRUN"]
                print(f"on edge-b {failover_s:.1f} s after edge-a was killed ({len(connections) - 1} connection attempts), "
                      f"resumed at sentence {resumed_at}, {len(underruns)} underruns")
                assert connections[0] == f"ws://127.0.0.1:{port_a}/ws" and connections[-1] == f"ws://127.0.0.1:{port_b}/ws"

                # Between turns (bench chaos, kind edge): B dies after turn-1 was played to its end,
                # turn-2 is spoken whole (and ends) while no edge runs, an edge starts again on A's
                # port. The player says it finished turn-1 (resume ... finished) and hears turn-2:
                # without that, an ended turn is not sent to a reconnecting player and turn-2 was lost.
                edge_b.kill()
                turn2 = tone_turn(session, "turn-2", sentences=2, chunks_per_sentence=2,
                                  leading_silence_s=LEADING_SILENCE_S, encoding=AudioEncoding.OPUS)
                await publish_audio(settings, turn2)
                edges.append(EdgeProcess(settings, port_a, "edge-a2", tmp_path / "edge-a2.log"))
                await wait_in_page(page, "window.voicebusPlayer.edge === 'edge-a2' && window.voicebusPlayer.state === 'ready'",
                                   timeout_ms=60000)
                hello = await page.evaluate("window.voicebusPlayer.lastHello")
                assert hello["resume"] == {"turn_id": "turn-1", "sentence_seq": 0, "finished": True}, hello
                await read_topic(settings, settings.playback_topic, "PlaybackReport",
                                 lambda v: any(r["kind"] == "PLAYBACK_END" and r["turn_id"] == "turn-2" for r in v),
                                 timeout=60)
                assert not errors and not [e for e in await page.evaluate("window.voicebusPlayer.errors")
                                           if e.get("code") != "no-owner"]
            finally:
                await browser.close()
    except BaseException:
        for name in ("edge-a", "edge-b", "edge-a2"):
            log_path = tmp_path / f"{name}.log"
            if log_path.exists():
                print(f"--- {name} log ---\n" + log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        for edge in edges:
            edge.stop()
