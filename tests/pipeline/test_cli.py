"""The command line says the same thing the same way everywhere: every command's parser, walked
(`voicebus.cli.command_parsers`), spells a language ``--language``, a log level ``--log-level``,
writes JSON with ``--json PATH``, and takes the global ``--bootstrap`` before or after its name."""

from __future__ import annotations

import argparse
import json

import pytest

from voicebus.cli import build_parser, command_parsers, json_to_stdout, main, write_json
from voicebus.settings import Settings

PARSER = build_parser()
COMMANDS = dict(command_parsers(PARSER))
LONG_RUNNING = ["voicebus gate", "voicebus worker", "voicebus edge", "voicebus demo", "voicebus bench gate",
                "voicebus bench scale", "voicebus bench ttfa", "voicebus bench agents", "voicebus bench chaos",
                "voicebus bench hostile"]
# `voicebus settings --json` is still a flag (one JSON object per line on stdout): its module,
# pipeline/settings_cli.py, is being changed elsewhere; this marker goes once it takes a PATH.
JSON_FLAG_PENDING: set[str] = set()


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def test_the_walk_finds_every_command_and_the_nested_ones():
    assert {"voicebus segment", "voicebus gate", "voicebus worker", "voicebus say", "voicebus kafka start",
            "voicebus bench scale", "voicebus bench segment"} <= COMMANDS.keys()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_language_is_chosen_with_language_and_lang_is_only_its_old_alias(name):
    for action in COMMANDS[name]._actions:
        if "--lang" in action.option_strings or action.dest in {"lang", "language"}:
            assert action.option_strings[0] == "--language", (name, action.option_strings)
            assert action.dest == "language", name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_log_level_is_chosen_with_log_level_and_loglevel_is_only_its_old_alias(name):
    for action in COMMANDS[name]._actions:
        if "--loglevel" in action.option_strings or action.dest in {"loglevel", "log_level"}:
            assert action.option_strings[0] == "--log-level", (name, action.option_strings)
            assert action.dest == "log_level", name


@pytest.mark.parametrize("name", LONG_RUNNING)
def test_every_long_running_command_takes_log_level(name):
    action = options(COMMANDS[name])["--log-level"]
    assert set(action.choices) == {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
    assert action.type("debug") == "DEBUG"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(
    strict=True, reason="pipeline/settings_cli.py is changed elsewhere")) if n in JSON_FLAG_PENDING else n
    for n in sorted(n for n, p in COMMANDS.items() if "--json" in options(p))])
def test_every_json_option_takes_a_path(name):
    action = options(COMMANDS[name])["--json"]
    assert action.nargs is None and action.default is None, (name, action)
    assert PARSER.parse_args([*name.split()[1:], "--json", "-"]).json == "-"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_takes_bootstrap_after_its_name(name):
    assert options(COMMANDS[name])["--bootstrap"].metavar == "HOST:PORT"


def test_bootstrap_before_or_after_the_command_and_the_last_one_wins():
    say = ["say", "hello", "--session", "s1"]
    assert PARSER.parse_args(["--bootstrap", "127.0.0.1:1", *say]).bootstrap == "127.0.0.1:1"
    assert PARSER.parse_args([*say, "--bootstrap", "127.0.0.1:2"]).bootstrap == "127.0.0.1:2"
    assert PARSER.parse_args(["--bootstrap", "127.0.0.1:1", *say, "--bootstrap", "127.0.0.1:2"]).bootstrap == "127.0.0.1:2"
    assert PARSER.parse_args(["bench", "--bootstrap", "h:3", "scale"]).bootstrap == "h:3"
    assert PARSER.parse_args(["--bootstrap", "a:1, b:2", *say]).bootstrap == "a:1,b:2"
    assert not hasattr(PARSER.parse_args(say), "bootstrap")  # not given: VOICEBUS_BOOTSTRAP's
    with pytest.raises(SystemExit):
        PARSER.parse_args(["--bootstrap", "no-port", *say])


def _settings_json(argv: list[str], capsys) -> dict[str, dict]:
    assert main([*argv, "--json", "-"]) == 0
    return {row["field"]: row for row in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize("argv", [["--bootstrap", "127.0.0.1:1", "settings"], ["settings", "--bootstrap", "127.0.0.1:1"]])
def test_bootstrap_overrides_the_environment_before_the_command_runs(argv, capsys, monkeypatch):
    monkeypatch.setenv("VOICEBUS_BOOTSTRAP", "127.0.0.1:9")
    assert _settings_json(argv, capsys)["bootstrap"]["value"] == "127.0.0.1:1"
    assert _settings_json(["settings"], capsys)["bootstrap"]["value"] == "127.0.0.1:9"


def test_json_dash_puts_the_json_alone_on_stdout_and_the_report_on_stderr(capsys, tmp_path):
    with json_to_stdout(argparse.Namespace(json="-")):
        print("a table for people")
        write_json("-", {"p50_ms": 1.5}, indent=None)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"p50_ms": 1.5} and captured.err == "a table for people\n"
    write_json(tmp_path / "deep" / "out.json", [1, 2])  # a file: its folder made first
    assert json.loads((tmp_path / "deep" / "out.json").read_text()) == [1, 2]
    write_json(None, {"nothing": "written"})
    assert capsys.readouterr().out == ""


def test_old_spellings_still_work():
    assert PARSER.parse_args(["segment", "--lang", "es"]).language == "es"
    assert PARSER.parse_args(["synth", "--text", "x", "--out", "x.wav", "--lang", "pt"]).language == "pt"
    assert PARSER.parse_args(["gate", "--loglevel", "info"]).log_level == "INFO"


def test_stage_command_lines_built_in_code_parse_and_carry_the_log_level():
    from voicebus.gate.cli import add_worker_arguments as gate_arguments
    from voicebus.ops.bench.chaos import make_stages
    from voicebus.synthesis.cli import add_worker_arguments as worker_arguments

    parsers = {"voicebus.gate.cli": gate_arguments, "voicebus.synthesis.cli": worker_arguments}
    for level, expected in ((None, {"gate": "WARNING", "worker": "INFO", "edge": "INFO"}),
                            ("DEBUG", {"gate": "DEBUG", "worker": "DEBUG", "edge": "DEBUG"})):
        for name, stage in make_stages(Settings(edge_port=1), log_level=level).items():
            module = stage.cmd[2]
            if module == "voicebus":
                args = PARSER.parse_args(stage.cmd[3:])
            else:
                parser = argparse.ArgumentParser()
                parsers[module](parser)
                args = parser.parse_args(stage.cmd[3:])
            assert "--loglevel" not in stage.cmd and args.log_level == expected[name], (name, stage.cmd)


@pytest.mark.parametrize("argv", [["bench", "chaos"], ["bench", "failover"], ["bench", "bus", "--brokers", "1,3"]])
def test_a_bench_that_starts_its_own_clusters_refuses_bootstrap_and_starts_nothing(argv, capsys):
    assert main(["--bootstrap", "127.0.0.1:1", *argv]) == 2
    assert "--bootstrap does not apply" in capsys.readouterr().err


def test_a_given_bootstrap_starts_no_broker():
    from voicebus.ops.bench.cli import bench_kafka
    from voicebus.ops.daemon import free_port

    settings = Settings(bootstrap=f"127.0.0.1:{free_port()}")  # nothing answers there
    with bench_kafka(argparse.Namespace(bootstrap=settings.bootstrap), settings) as live:
        assert live is settings  # as given: no broker was started in its place
