"""Output paths from data stay in their folder: the demo's `out/<conversation>/<turn_id>.wav`."""

from pathlib import Path

import pytest

from voicebus.ops.demo_shared import wav_path
from voicebus.paths import UnsafePath, path_under, safe_name

HOSTILE = ["..", ".", "../../etc/passwd", "/etc/passwd", "a/b", "a\\b", "..\\..\\x", "~", ".hidden",
           "x\x00y", "C:\\temp", "%2E%2E", "ü/ß", "\ud800"]


@pytest.mark.parametrize("turn_id", HOSTILE)
def test_the_demo_writes_hostile_turn_ids_inside_its_folder(tmp_path, turn_id):
    out = tmp_path / "out"
    path = wav_path(out, "support", turn_id)
    assert path.parent == out / "support" and path.suffix == ".wav"
    assert path.resolve().is_relative_to(out.resolve())
    assert "/" not in path.name and "\\" not in path.name and not path.name.startswith(".")


@pytest.mark.parametrize("conversation", ["..", "../..", "/tmp", "a/../../b", "support.jsonl/.."])
def test_hostile_conversation_names_stay_inside_too(tmp_path, conversation):
    path = wav_path(tmp_path, conversation, "t1")
    assert path.parent.parent == tmp_path and path.name == "t1.wav"


def test_plain_names_are_kept_and_the_encoding_is_one_to_one():
    assert wav_path(Path("out/demo"), "support", "t1") == Path("out/demo/support/t1.wav")
    assert wav_path(Path("out/demo"), "support.jsonl", "turn-2_b.x") == Path("out/demo/support/turn-2_b.x.wav")
    names = ["a/b", "a_b", "a%2Fb", "a%252Fb", "..", "%2E.", ".%2E"]
    assert len({safe_name(n) for n in names}) == len(names)


def test_empty_too_long_and_symlinked_names_are_refused(tmp_path):
    with pytest.raises(UnsafePath, match="empty"):
        safe_name("")
    with pytest.raises(UnsafePath, match="too long"):
        safe_name("x" * 201)
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    with pytest.raises(UnsafePath, match="leaves"):
        path_under(tmp_path / "root", "link", "x")
