"""`voicebus say`, `replay` and `record` run as commands against the real broker."""

import asyncio

import pytest

from agents.conversation_file import load
from pipeline.cli import build_parser
from pipeline.topics import text_topic
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

    assert _run(settings, "replay", "support", "--speed", "20", "--sessions", "2") == 0
    printed = capsys.readouterr().out
    assert "replayed 126 events in 2 copies" in printed and printed.count("support-1 -> support-1.") == 2
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
                sys.executable, "-m", "pipeline", "say", "--agent", "bot", "--session", "s1", "--token-ms", "100",
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
