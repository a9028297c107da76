"""players/web/edge-client.js in Debian's headless chromium, the module both pages import: the
audio frames voicebus.players.protocol encodes read back field for field (the two sides of one contract),
and the edge's clock estimated afresh for each edge the page connects to."""

import base64

import pytest

from voicebus.players import protocol
from tests.players.edge_helpers import edge_settings, running_edge
from tests.players.test_browser_e2e import CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.browser]


async def _in_page(script: str, arg=None):
    """Evaluate `script` (a JS function of the module and `arg`) in a page the edge served."""
    from playwright.async_api import async_playwright

    async with running_edge(edge_settings(), with_kafka=False) as (app, client), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(str(client.make_url("/")))
            return await page.evaluate(
                f"async (arg) => {{ const m = await import('/web/edge-client.js'); return ({script})(m, arg); }}", arg)
        finally:
            await browser.close()


async def test_the_page_reads_the_audio_frames_the_edge_writes():
    pcm = b"".join(v.to_bytes(2, "little", signed=True) for v in (0, 16384, -32768, 32767))
    frames = {
        "pcm": protocol.encode_audio(protocol.AudioFrame(
            turn=7, sentence=3, chunk=2, sample_rate=24000, pcm=pcm,
            flags=protocol.FLAG_LAST_IN_SENTENCE | protocol.FLAG_LAST_IN_TURN)),
        "opus": protocol.encode_audio(protocol.AudioFrame(
            turn=1, sentence=0, chunk=0, sample_rate=48000, pcm=b"\x03\x00abc",
            flags=protocol.FLAG_FIRST_IN_SENTENCE, encoding=protocol.ENCODING_OPUS)),
    }
    pcm_frame = frames["pcm"]
    frames["other version"] = pcm_frame[:1] + bytes([protocol.PROTOCOL_VERSION + 1]) + pcm_frame[2:]
    frames["other type"] = bytes([0x7F]) + pcm_frame[1:]
    frames["short"] = pcm_frame[:protocol.AUDIO_HEADER_LEN - 1]
    read = await _in_page("""(m, frames) => {
        const out = {};
        for (const [name, b64] of Object.entries(frames)) {
            const buffer = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)).buffer;
            const f = m.parseAudioFrame(buffer);
            out[name] = f && { flags: f.flags, encoding: f.encoding, turn: f.turn, sentence: f.sentence,
                               chunk: f.chunk, sampleRate: f.sampleRate,
                               samples: f.encoding === m.ENCODING_PCM16LE ? Array.from(m.pcm16Samples(buffer)) : null };
        }
        out.constants = [m.PROTOCOL_VERSION, m.FRAME_AUDIO, m.HEADER_BYTES, m.FLAG_LAST_IN_SENTENCE,
                         m.FLAG_LAST_IN_TURN, m.FLAG_FIRST_IN_SENTENCE, m.ENCODING_PCM16LE, m.ENCODING_OPUS];
        return out;
    }""", {name: base64.b64encode(frame).decode() for name, frame in frames.items()})

    assert read["constants"] == [protocol.PROTOCOL_VERSION, protocol.FRAME_AUDIO, protocol.AUDIO_HEADER_LEN,
                                 protocol.FLAG_LAST_IN_SENTENCE, protocol.FLAG_LAST_IN_TURN,
                                 protocol.FLAG_FIRST_IN_SENTENCE, protocol.ENCODING_PCM16LE, protocol.ENCODING_OPUS]
    assert read["pcm"] == {"flags": 3, "encoding": 1, "turn": 7, "sentence": 3, "chunk": 2, "sampleRate": 24000,
                           "samples": [0, 0.5, -1, 32767 / 32768]}
    assert read["opus"] == {"flags": 4, "encoding": 2, "turn": 1, "sentence": 0, "chunk": 0, "sampleRate": 48000,
                            "samples": None}
    assert read["other version"] is None and read["other type"] is None and read["short"] is None


async def test_the_clock_is_estimated_afresh_for_each_edge():
    # Edge A answers a ping in 1 ms. The page then moves to edge B (a redirect or a failover), whose
    # clock is 5 s ahead and whose round trip is 10 ms; its `ready` arrives 40 ms after it was
    # stamped. B's first pong must set the offset: with A's 1 ms still the best round trip, it was
    # ignored and the offset stayed 40 ms off (the ready's one-way delay).
    got = await _in_page("""(m) => {
        const clock = new m.EdgeClock();
        const at = (perfMs) => (performance.timeOrigin + perfMs) * 1000;  // a client instant, epoch µs
        const t = performance.now();
        clock.onReady(at(t));
        clock.onPong({ t0: t, server_time_us: at(t + 0.5) }, t + 1);
        const onA = { offsetUs: clock.offsetUs, samples: clock.samples };
        const ahead = 5e6;
        clock.onReady(m.clientNowUs() + ahead - 40e3);
        const t0 = performance.now();
        clock.onPong({ t0, server_time_us: at(t0 + 5) + ahead }, t0 + 10);
        return { onA, offsetUs: clock.offsetUs, rttUs: clock.rttUs, samples: clock.samples, ahead };
    }""")
    # (epoch µs in doubles: ~0.25 µs apart; the failure this guards against is 40 000 µs)
    assert abs(got["onA"]["offsetUs"]) < 10 and got["onA"]["samples"] == 1
    assert abs(got["offsetUs"] - got["ahead"]) < 10, got  # B's pong, not the ready's late estimate
    assert got["rttUs"] == pytest.approx(10_000) and got["samples"] == 1
