"""The whole pipeline through the real broker: agent -> gate -> synthesis worker -> edge -> listener.

Real Kafka, the real gate (a subprocess), the real kokoro code (tiny random weights), the
real edge over a WebSocket. These are the paths the demo and `voicebus bench ttfa` stand on.
"""

from __future__ import annotations

import asyncio

import pytest

from voicebus.agents.sdk import FloorFollower, Publisher
from voicebus.ops.daemon import free_port
from voicebus.bus import read_to_end
from voicebus.codecs import Codec
from voicebus.ops.runtime import PipelineStack
from voicebus.synthesis.engine import SynthesisEngine
from voicebus.players.listener import Listener
from tests.waiting import eventually

pytestmark = pytest.mark.kafka

STAGES = ["first_token_at_us", "text_complete_at_us", "released_at_us", "request_received_at_us",
          "synthesis_started_at_us", "audio_ready_at_us", "published_at_us", "edge_received_at_us", "sent_at_us"]


@pytest.fixture(scope="module")
def engine():
    return SynthesisEngine.tiny(seed=3)


async def _speak(settings, session_id: str, turn_id: str, pieces: list[str], token_s: float = 0.02) -> None:
    async with Publisher(settings, agent_id="assistant") as publisher:
        async with publisher.turn(session_id, turn_id, language="en") as turn:
            for piece in pieces:
                await turn.token(piece)
                await asyncio.sleep(token_s)


async def test_a_turn_flows_end_to_end_in_order_with_every_stage_stamped(make_settings, engine):
    settings = make_settings(edge_port=free_port(), worker_max_in_flight=2)
    async with PipelineStack(settings, engine) as stack:
        async with Listener(stack.edge_url, "s-e2e", settings.edge_secret) as listener:
            await _speak(stack.settings, "s-e2e", "t1", ["Hello", " there.", " How", " are", " you?", " Fine", " thanks."])
            turn = await listener.wait_turn_end("t1", timeout=240)

    sentences = [sentence for _, sentence, _, _ in turn.frames]
    assert sentences == sorted(sentences), "a session's audio arrives in sentence order"
    assert set(sentences) >= {0, 1, 2}, (
        f"stopped={turn.stopped} discarded={turn.discarded} after_stop={turn.frames_after_stop} "
        f"frames={turn.frames} timelines={sorted(turn.timelines)}")
    assert turn.duration_s > 0.3
    for sentence, timeline in turn.timelines.items():
        stamps = [timeline[k] for k in STAGES]
        assert all(stamps), f"sentence {sentence}: a stage has no timestamp: {timeline}"
        assert stamps == sorted(stamps), f"sentence {sentence}: stages out of order: {dict(zip(STAGES, stamps))}"
    assert turn.first_audio_at_us >= turn.timelines[sentences[0]]["published_at_us"]


def seen_cancel_at_us(stack) -> int:
    """When the worker saw the cancel: the ping's answer (the edge's clock, this machine's) comes later."""
    return max((o.seen_at_us for o in stack.lanes["main"].worker.cancel_log), default=0)


async def test_a_barge_in_purges_the_turn_everywhere(make_settings, engine):
    settings = make_settings(edge_port=free_port(), worker_max_in_flight=2)
    text = " ".join(f"Sentence number {n} is here." for n in range(8))
    pieces = [w + " " for w in text.split()]
    async with PipelineStack(settings, engine) as stack:
        async with Listener(stack.edge_url, "s-cancel", settings.edge_secret) as listener:
            # 50 ms a token: the last sentence ends ~2 s in, well after the cancel has reached
            # the gate and the worker even on a loaded machine
            speaking = asyncio.create_task(_speak(stack.settings, "s-cancel", "t1", pieces, token_s=0.05))
            await eventually(lambda: "t1" in listener.turns and listener.turns["t1"].frames, timeout_s=240,
                             interval_s=0.01, what="the turn's first audio at the listener")
            await listener.cancel("t1")
            await speaking
            # Everything still in the pipeline arrives: each stage through, then a ping round
            # trip behind whatever the edge already wrote to the listener.
            await eventually(stack.drained, timeout_s=120, interval_s=0.2, what="the pipeline drained",
                         detail=lambda: stack.undrained)
            assert await listener.ping() > seen_cancel_at_us(stack)
            turn = listener.turns["t1"]
            worker = stack.lanes["main"].worker
            seen = [o for o in worker.cancel_log if o.session_id == "s-cancel"]

            # everything the worker published for that turn, read back from the audio topic
            records = await read_to_end(stack.settings, [stack.settings.audio_topic])

    assert turn.stopped, "the edge told the player to stop"
    # Frames already on the wire when the cancel left may still arrive (the player discards
    # them); after its "stop" the edge sends nothing of the turn.
    assert turn.frames_after_stop == 0, f"the edge sent audio after its stop ({len(turn.discarded)} discarded in all)"
    assert seen, "the worker saw the cancel on the control topic"
    codec = Codec()
    chunks = [codec.decode(r.value).value for r in records]
    mine = [c for c in chunks if c["session_id"] == "s-cancel"]
    assert mine, "some audio was published before the cancel"
    assert max(c["published_at_us"] for c in mine) <= seen[0].seen_at_us + 5_000
    assert max(c["sentence_seq"] for c in mine) < 7, "the rest of the answer was never synthesized"


async def test_a_retracted_tentative_sentence_never_reaches_a_player(make_settings, engine):
    """Speculative release on: "Visit example." goes out tentative at once; the worker
    synthesizes it and holds its audio (parked); the glued "com" then withdraws it. The
    listener hears only the corrected sentence, and the audio topic holds no chunk of the
    tentative job."""
    from tests.waiting import eventually

    settings = make_settings(edge_port=free_port(), worker_max_in_flight=2, speculative_release=True,
                             first_clause_min_words=0)
    async with PipelineStack(settings, engine) as stack:
        worker = stack.lanes["main"].worker
        async with Listener(stack.edge_url, "s-spec", settings.edge_secret) as listener:
            async with Publisher(stack.settings, agent_id="assistant") as publisher:
                async with publisher.turn("s-spec", "t1", language="en") as turn:
                    await turn.token("Visit")
                    await turn.token(" example.")
                    # its audio was made and is held, not published
                    parked = await eventually(lambda: [j for j in worker.scheduler.parked if j.session_id == "s-spec"],
                                              timeout_s=120, what="the tentative sentence synthesized and parked")
                    tentative_job = parked[0]
                    held_chunks = len(tentative_job.held)
                    assert tentative_job.request.tentative and tentative_job.request.text == "Visit example."
                    await turn.token("com")
                    await eventually(lambda: tentative_job not in worker.scheduler.parked, timeout_s=60,
                                     what="the withdrawal applied")
                    await turn.token(" today.")
            heard = await listener.wait_turn_end("t1", timeout=240)

            records = await read_to_end(stack.settings, [stack.settings.audio_topic])

    assert sorted({sentence for _, sentence, _, _ in heard.frames}) == [0]
    codec = Codec()
    mine = [c for r in records if (c := codec.decode(r.value).value)["session_id"] == "s-spec"]
    assert mine and all(c["sentence_seq"] == 0 for c in mine)
    # every chunk published is the replacement's: none carries the tentative job's stamps
    assert all(c["request_received_at_us"] > tentative_job.received_at_us for c in mine)
    assert sorted(c["chunk_seq"] for c in mine) == list(range(len(mine)))
    assert mine[-1]["is_last_chunk"] and any(c["is_last_in_turn"] for c in mine)
    assert held_chunks > 0, "the tentative sentence's audio was made (and held)"
    assert worker.metrics.requests.labels("retracted")._value.get() >= 1


async def _say(settings, agent: str, session_id: str, turn_id: str, text: str, token_s: float = 0.1,
               **turn_options) -> None:
    """One agent's turn, one word a token every `token_s` (as `voicebus say` does)."""
    async with Publisher(settings, agent_id=agent) as publisher:
        async with publisher.turn(session_id, turn_id, language="en", **turn_options) as turn:
            for word in text.split():
                await turn.token(word + " ")
                await asyncio.sleep(token_s)


HOST = "Welcome to the show tonight. We talk about the sea. It is deep and wide. Stay with us."
EXPERT = "Thanks for having me. The sea covers most of the planet. Its depths are dark. Few have seen them."


@pytest.mark.long  # queueing whole turns: the priority test below and test_bench_floor's short run
async def test_two_agents_overlapping_in_a_session_are_heard_one_whole_turn_after_the_other(make_settings, engine):
    """The floor (queue, the default): a host and an expert start 4-sentence turns 0.5 s apart;
    the listener gets every sentence of the host's turn, then every sentence of the expert's.
    Both agents' topics exist before the gate starts (as for agents that have spoken before): a
    topic the gate discovers while the turns run may reach it after the other agent's first token,
    under load, and the floor goes in the order the gate sees turns open."""
    settings = make_settings(edge_port=free_port(), worker_max_in_flight=2, first_clause_min_words=0)
    async with PipelineStack(settings, engine, agent_ids=("host", "expert")) as stack:
        async with Listener(stack.edge_url, "s-floor", settings.edge_secret) as listener, \
                Publisher(stack.settings, agent_id="expert") as expert, FloorFollower(expert) as floor:
            host = asyncio.create_task(_say(stack.settings, "host", "s-floor", "host-1", HOST))
            await asyncio.sleep(0.5)
            # the expert speaks English with a Japanese voice: it is told so on its floor events
            await _say(stack.settings, "expert", "s-floor", "expert-1", EXPERT, voice="jf_alpha")
            await host
            first = await listener.wait_turn_end("host-1", timeout=240)
            second = await listener.wait_turn_end("expert-1", timeout=240)
            # what each agent is told about the floor
            host_granted = await floor.wait("s-floor", "host-1", "GRANTED", timeout_s=60)
            queued = await floor.wait("s-floor", "expert-1", "QUEUED", timeout_s=60)
            granted = await floor.wait("s-floor", "expert-1", "GRANTED", timeout_s=60)

    assert sorted({s for _, s, _, _ in first.frames}) == [0, 1, 2, 3]
    assert sorted({s for _, s, _, _ in second.frames}) == [0, 1, 2, 3]
    assert not first.stopped and not second.stopped
    assert max(f[0] for f in first.frames) < min(f[0] for f in second.frames), "the two turns were spliced"
    assert host_granted.waited_us == 0 and queued.agent_id == "expert"
    assert granted.waited_us > 1_000_000  # the host's four sentences of text took ~1.7 s
    assert host_granted.warnings == ()
    assert queued.warnings == granted.warnings == (
        "voice-language-mismatch: jf_alpha is a Japanese voice; the turn is American English",)


async def test_a_preempting_turn_cuts_the_speaker_at_its_first_sentence(make_settings, engine):
    """``floor=preempt``: the expert's turn cuts the host's once its first sentence is released;
    the gate publishes the cut as a cancel (source ``floor``), the edge stops the host's turn at
    the listener, the rest of the host's turn is never heard, and the expert's turn is heard whole."""
    settings = make_settings(edge_port=free_port(), worker_max_in_flight=2, first_clause_min_words=0)
    async with PipelineStack(settings, engine) as stack:
        async with Listener(stack.edge_url, "s-preempt", settings.edge_secret) as listener:
            async with Publisher(stack.settings, agent_id="host") as publisher:
                async with publisher.turn("s-preempt", "host-1", language="en") as host:
                    for word in "Welcome to the show tonight. We talk".split():
                        await host.token(word + " ")
                    await eventually(lambda: "host-1" in listener.turns and listener.turns["host-1"].frames,
                                     timeout_s=240, interval_s=0.01, what="the host's first audio at the listener")
                    await _say(stack.settings, "expert", "s-preempt", "expert-1", EXPERT, token_s=0.02,
                               floor="preempt")
                    await eventually(lambda: listener.turns["host-1"].stopped, timeout_s=120,
                                     what="the host's turn stopped at the listener")
                    for word in "about the sea. It is deep and wide. Stay with us.".split():
                        await host.token(word + " ")  # after the cut: the gate ignores it
            second = await listener.wait_turn_end("expert-1", timeout=240)
            await eventually(stack.drained, timeout_s=120, interval_s=0.2, what="the pipeline drained",
                         detail=lambda: stack.undrained)
            await listener.ping()
            first = listener.turns["host-1"]
            records = await read_to_end(stack.settings, [stack.settings.control_topic])

    assert first.frames_after_stop == 0
    assert {s for _, s, _, _ in first.frames} == {0}, "nothing of the host's turn after the cut was heard"
    # the host is heard until the expert can be: its stop comes right before the expert's first audio
    expert_first_audio = min(f[0] for f in second.frames)
    assert first.stopped_at_us <= expert_first_audio < first.stopped_at_us + 100_000
    assert sorted({s for _, s, _, _ in second.frames}) == [0, 1, 2, 3] and not second.stopped
    codec = Codec()
    cuts = [e for r in records if (e := codec.decode(r.value).value)["session_id"] == "s-preempt"]
    assert [(c["turn_id"], c["source"], c["after_turn_id"]) for c in cuts] == [("host-1", "floor", "expert-1")]


async def test_a_priority_turn_preempts_an_equal_one_queues_and_a_cancelled_waiting_turn_never_plays(
        make_settings, engine):
    """Through the pipeline: a peer of the host's priority queues behind it; an alert (priority 5)
    cuts the host and speaks before the peer; a third agent's turn cancelled while it waits is
    never heard; the peer is heard whole after the alert."""
    settings = make_settings(edge_port=free_port(), worker_max_in_flight=2, first_clause_min_words=0)
    async with PipelineStack(settings, engine) as stack:
        async with Listener(stack.edge_url, "s-prio", settings.edge_secret) as listener, \
                Publisher(stack.settings, agent_id="host") as host_agent, \
                Publisher(stack.settings, agent_id="peer") as peer_agent, \
                Publisher(stack.settings, agent_id="late") as late_agent, \
                Publisher(stack.settings, agent_id="alert", priority=5) as alert_agent, \
                FloorFollower(peer_agent) as floor:
            async with host_agent.turn("s-prio", "host-1", language="en") as host:
                for word in "Welcome to the show tonight. We talk".split():
                    await host.token(word + " ")
                await eventually(lambda: "host-1" in listener.turns and listener.turns["host-1"].frames,
                                 timeout_s=240, interval_s=0.01, what="the host's first audio")
                async with peer_agent.turn("s-prio", "peer-1", language="en") as peer:
                    await peer.tokens(["Me ", "too. ", "I ", "will ", "wait. "])
                late = late_agent.turn("s-prio", "late-1", language="en")
                await late.token("Never heard. ")
                await floor.wait("s-prio", "late-1", "QUEUED", timeout_s=60)
                await late.cancel()
                async with alert_agent.turn("s-prio", "alert-1", language="en") as alert:
                    await alert.tokens(["Storm ", "warning ", "now. ", "Stay ", "inside. "])
                await eventually(lambda: listener.turns["host-1"].stopped, timeout_s=120,
                                 what="the host's turn stopped at the listener")
                await host.token("about the sea. ")
            alert_heard = await listener.wait_turn_end("alert-1", timeout=240)
            peer_heard = await listener.wait_turn_end("peer-1", timeout=240)
            await eventually(stack.drained, timeout_s=120, interval_s=0.2, what="the pipeline drained",
                         detail=lambda: stack.undrained)
            await listener.ping()

    assert "late-1" not in listener.turns, "a cancelled waiting turn was heard"
    assert sorted({s for _, s, _, _ in alert_heard.frames}) == [0, 1] and not alert_heard.stopped
    assert sorted({s for _, s, _, _ in peer_heard.frames}) == [0, 1] and not peer_heard.stopped
    assert max(f[0] for f in alert_heard.frames) < min(f[0] for f in peer_heard.frames), "alert and peer spliced"
    assert {s for _, s, _, _ in listener.turns["host-1"].frames} == {0}
