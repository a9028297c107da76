"""`voicebus token` and `voicebus bench edge` through the real command line."""

from urllib.parse import parse_qs, urlparse

from voicebus.cli import main
from voicebus.players.auth import verify_token


def test_token_command_prints_a_valid_token_and_the_player_url(capsys, monkeypatch):
    monkeypatch.setenv("VOICEBUS_EDGE_SECRET", "cli-secret")
    assert main(["token", "--session", "demo-1", "--ttl", "60"]) == 0
    token, url = capsys.readouterr().out.split()
    verify_token("cli-secret", token, "demo-1")
    # the token rides in the fragment, which browsers never send to a server (no access log sees it)
    parts = urlparse(url)
    assert parts.query == "" and token not in parts.path
    assert parse_qs(parts.fragment) == {"session": ["demo-1"], "token": [token]}


def test_bench_edge_prints_percentiles_per_client_count(capsys):
    assert main(["bench", "edge", "--clients", "1,3", "--chunks", "10", "--interval-ms", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {int(line.split()[0]): line.split() for line in lines if line.split() and line.split()[0].isdigit()}
    assert rows[1][1] == "10" and rows[3][1] == "30"  # one sample per (chunk, client)
    assert all(float(rows[n][2]) > 0 for n in rows)
