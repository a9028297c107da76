"""`voicebus voices`: which voices the worker would load, their languages, and the fallbacks."""

from __future__ import annotations

from voicebus.cli import main
from voicebus.settings import Settings
from voicebus.synthesis.weights import describe_voice, fallback_voice, voice_catalog


def weights_dir(tmp_path, voices):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "kokoro.pth").write_bytes(b"")
    (tmp_path / "voices").mkdir()
    for v in voices:
        (tmp_path / "voices" / f"{v}.pt").write_bytes(b"")
    return tmp_path


def test_the_catalog_lists_the_voices_with_language_and_the_fallbacks(tmp_path):
    settings = Settings(weights_path=weights_dir(tmp_path, ["bf_emma", "af_heart", "jm_kumo"]), cache_dir=tmp_path)
    catalog = voice_catalog(settings)
    assert catalog.source.startswith("local:")
    assert [(v.name, v.language_name, v.gender, v.spoken) for v in catalog.voices] == [
        ("af_heart", "American English", "female", True), ("bf_emma", "British English", "female", True),
        ("jm_kumo", "Japanese", "male", True)]
    assert catalog.fallback == "af_heart"
    assert catalog.per_language_default["a"] == ("af_heart", True)
    assert catalog.per_language_default["e"] == ("ef_dora", False)


def test_without_the_default_voice_the_first_voice_by_name_is_the_fallback():
    assert fallback_voice("af_heart", ["jm_kumo", "jf_alpha"]) == "jf_alpha"
    assert fallback_voice("af_heart", []) is None
    assert describe_voice("pm_alex").language_name == "Brazilian Portuguese"


def test_the_command_prints_voices_and_fallback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VOICEBUS_WEIGHTS_PATH", str(weights_dir(tmp_path, ["jf_alpha"])))
    assert main(["voices"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "jf_alpha" in out and "Japanese (j)" in out
    assert "af_heart (missing: synthesized with jf_alpha)" in out
    assert "a voice that is not available is synthesized with jf_alpha" in out


def test_no_weights_is_a_failure_exit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VOICEBUS_WEIGHTS_PATH", str(tmp_path / "nothing"))
    assert main(["voices"]) == 1
    assert "none (" in capsys.readouterr().out


def test_the_command_tells_of_mixes_and_synth_refuses_a_voice_that_is_no_spec(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VOICEBUS_WEIGHTS_PATH", str(weights_dir(tmp_path, ["af_bella", "af_heart"])))
    monkeypatch.setenv("VOICEBUS_DEFAULT_VOICE", "af_heart:0.7+af_bella:0.3")
    assert main(["voices"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "American English (a, en, en-us, en_us): af_heart:0.7+af_bella:0.3 (available)" in out
    assert "synthesized with af_heart:0.7+af_bella:0.3" in out and "e.g. af_heart:0.7+af_bella:0.3" in out
    assert main(["synth", "--tiny", "--text", "Hi.", "--voice", "af_heart:0.7+", "--out", str(tmp_path / "x.wav")]) == 2
    assert "no voice on one side" in capsys.readouterr().err and not (tmp_path / "x.wav").exists()
