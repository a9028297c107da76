"""`voicebus say`, `replay` and `record` run as commands against the real broker."""

import asyncio

import pytest

from voicebus.agents.conversation_file import load
from voicebus.agents.corpus import corpus_path
from voicebus.cli import build_parser
from voicebus.topics import text_topic
from tests.agents.bus_helpers import TopicReader, count_kind

pytestmark = pytest.mark.kafka


def _run(settings, *argv):
    args = build_parser().parse_args(list(argv))
    return args.func(args, settings)


def test_say_then_record_and_replay_commands(make_settings, tmp_path, capsys):
    settings = make_settings()
    assert _run(settings, "say", "--agent", "bot", "--session", "s1", "--token-ms", "5", "Hi there. Bye.") == 0

    async def read_back():
        async with TopicReader(settings, [text_topic(settings, "bot")]) as reader:
            return await reader.wait_for(count_kind("END_OF_TURN"))

    got = asyncio.run(read_back())
    assert "".join(r.value["text"] for r in got) == "Hi there. Bye."
    assert got[-1].value["kind"] == "END_OF_TURN"

    # record with a bound in time only (nothing is published meanwhile): an empty, valid file
    out = tmp_path / "empty.jsonl"
    assert _run(settings, "record", str(out), "--duration", "1") == 0
    assert load(out).events == []

    assert _run(settings, "replay", "support", "--speed", "20", "--sessions", "2", "--heard-timeout", "0.5") == 0
    printed = capsys.readouterr().out
    assert "replayed 126 events in 2 copies" in printed and printed.count("support-1 -> support-1.") == 2
    # nobody listened: each turn of each copy says so
    assert printed.count("no TurnHeard within 0.5 s") == 2 * len(load(corpus_path("support")).turns())
    assert _run(settings, "replay", "no-such-conversation") == 2


def test_say_prints_the_turn_id_first_while_the_turn_is_still_being_spoken(make_settings):
    """The id comes before the turn ends, so a caller can cancel or follow the turn it started."""
    import os
    import subprocess
    import sys

    settings = make_settings()
    words = " ".join(f"word{i}" for i in range(40)) + "."

    async def run() -> tuple[str, list]:
        async with TopicReader(settings, [text_topic(settings, "bot")]) as reader:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "voicebus", "say", "--agent", "bot", "--session", "s1", "--token-ms", "100",
                words, env={**os.environ, **settings.to_env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                first = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                ended_before_the_id = any(r.value["kind"] == "END_OF_TURN" for r in reader.received)
                got = await reader.wait_for(count_kind("END_OF_TURN"), timeout_s=60)
                rest, err = await asyncio.wait_for(proc.communicate(), 30)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            assert proc.returncode == 0, err.decode()
            assert not ended_before_the_id
            return first, got

    first, got = asyncio.run(run())
    turn_id = got[0].value["turn_id"]
    assert first == f"turn {turn_id} of session s1 (agent bot)\n"


def test_replay_of_the_interrupted_conversation_prints_what_was_heard(make_settings, capsys):
    """`voicebus replay interrupted` waits for each turn's TurnHeard (here published as the edge
    would, once the replayed turn is on the bus) and prints it; a TurnHeard of the same session
    and turn from before the replay (an earlier run) is not taken for this one."""
    import dataclasses
    import threading

    from tests.agents.test_heard_kafka import publish_heard, turn_heard

    settings = make_settings()
    asyncio.run(publish_heard(settings, *(dataclasses.replace(turn_heard("barge-1", t, "an earlier run", True, []),
                                                              published_at_us=1) for t in ("t1", "t2"))))
    codes = []
    command = threading.Thread(target=lambda: codes.append(_run(
        settings, "replay", "interrupted", "--keep-session-ids", "--speed", "5", "--heard-timeout", "60")))
    command.start()

    async def edge_reports_what_was_heard():
        async with TopicReader(settings, [text_topic(settings, "assistant")]) as reader:
            await reader.wait_for(count_kind("END_OF_TURN"), timeout_s=60)  # t2 replayed: both turns are out
        await publish_heard(
            settings, turn_heard("barge-1", "t1", "There are three ways", True, ["to", "pay", "your", "bill."]),
            turn_heard("barge-1", "t2", "Sure, card works.", False, []))

    try:
        asyncio.run(edge_reports_what_was_heard())
    finally:
        command.join(90)
    assert codes == [0]
    printed = capsys.readouterr().out
    assert "barge-1 t1: interrupted, heard: 'There are three ways' (4 words not heard: to pay your bill.)" in printed
    assert "barge-1 t2: heard whole: 'Sure, card works.'" in printed
    assert "an earlier run" not in printed
