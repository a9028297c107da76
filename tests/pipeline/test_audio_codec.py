"""The audio encodings (pipeline/audio_codec.py): settings, frame alignment, Opus round trips."""

from __future__ import annotations

import numpy as np
import pytest

from voicebus.audio_codec import AudioCodecError, AudioFormat, OpusEncoder, audio_format, decode_payload
from voicebus.settings import Settings, SettingsError
from voicebus.players import protocol
from voicebus.players.tone import tone_pcm
from voicebus.schemas.contract import AudioEncoding, pack_opus_packets, split_opus_packets


def test_the_setting_chooses_the_encoding_and_refuses_what_cannot_be_made():
    assert audio_format(Settings(), 24_000).encoding == AudioEncoding.PCM16LE
    opus = audio_format(Settings.from_env({"VOICEBUS_AUDIO_ENCODING": "opus", "VOICEBUS_OPUS_BITRATE": "32000"}), 24_000)
    assert (opus.encoding, opus.bitrate, opus.frame_ms) == (AudioEncoding.OPUS, 32_000, 20)
    with pytest.raises(SettingsError, match="VOICEBUS_AUDIO_ENCODING"):
        audio_format(Settings(audio_encoding="mp3"), 24_000)
    with pytest.raises(AudioCodecError, match="22050"):
        audio_format(Settings(audio_encoding="opus"), 22_050)
    with pytest.raises(SettingsError, match="VOICEBUS_OPUS_FRAME_MS"):
        audio_format(Settings(audio_encoding="opus", opus_frame_ms=25), 24_000)
    with pytest.raises(AudioCodecError, match="bitrate"):
        audio_format(Settings(audio_encoding="opus", opus_bitrate=1_000), 24_000)


def test_chunks_are_cut_at_whole_opus_frames():
    opus = AudioFormat(AudioEncoding.OPUS)
    assert [opus.chunk_bytes(ms) // 48 for ms in (150, 100, 5, 330)] == [160, 100, 20, 320]
    assert AudioFormat().chunk_bytes(150) == 150 * 48  # PCM16: as asked
    with pytest.raises(AudioCodecError, match="whole 480-sample"):
        OpusEncoder().encode(b"\0\0" * 500, last=False)


def test_opus_at_24_kbits_keeps_a_tone_and_is_over_10x_smaller():
    pcm = tone_pcm(1.0, freq_hz=440.0)
    payload = OpusEncoder().encode(pcm, last=True)
    assert len(split_opus_packets(payload)) == 50 + 1  # one per 20 ms, and the flushed lookahead
    assert len(payload) * 10 < len(pcm)
    decoded = np.frombuffer(decode_payload(AudioEncoding.OPUS, payload), "<i2").astype(np.float64)
    spectrum = np.abs(np.fft.rfft(decoded[2400:21600]))
    assert abs(np.argmax(spectrum) * 24_000 / 19_200 - 440) < 2  # the same pitch
    assert decode_payload(AudioEncoding.PCM16LE, pcm) == pcm


def test_a_payload_that_is_not_opus_is_a_typed_error():
    with pytest.raises(AudioCodecError):
        decode_payload(AudioEncoding.OPUS, pack_opus_packets([b"\xff" * 40]))


def test_edge_frames_carry_opus_packets_as_the_bus_does():
    payload = OpusEncoder().encode(tone_pcm(0.1), last=True)
    frame = protocol.AudioFrame(1, 0, 0, 24_000, payload, encoding=protocol.ENCODING_OPUS)
    data = protocol.encode_audio(frame)
    assert data[3] == 0x02 and protocol.decode_audio(data) == frame
    with pytest.raises(protocol.MalformedFrame, match="Opus payload"):
        protocol.decode_audio(data[:-1])
    with pytest.raises(protocol.MalformedFrame, match="unknown audio encoding 0x03"):
        protocol.decode_audio(data[:3] + b"\x03" + data[4:])
