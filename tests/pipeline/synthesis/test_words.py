"""Word timings: the frames of each word's phonemes (less the decoder's lead) joined into written words, the espeak languages' phoneme
groups paired with their words, placement in the sentence, and the words on the chunks."""

from __future__ import annotations

import pytest
import torch
from misaki.token import MToken

from voicebus.codecs import Codec
from voicebus.schemas.messages import SynthesisRequest
from voicebus.synthesis.chunks import ChunkAssembler
from voicebus.synthesis.scheduler import SynthesisJob, synthesis_args
from voicebus.synthesis.words import (ACOUSTIC_LEAD_FRAMES, FRAME_S, TimedWord, WordTiming, english_words, heard_words,
                                      phoneme_words, place)

SR = 24000


def tok(text, phonemes, whitespace=" "):
    return MToken(text=text, tag="X", whitespace=whitespace, phonemes=phonemes)


def test_english_tokens_are_joined_into_the_words_as_written():
    # "Hello, don't." -> tokens Hello | , | don't | . ; phonemes "həlˈO, dˈOnt."
    tokens = [tok("Hello", "həlˈO", ""), tok(",", ","), tok("don't", "dˈOnt", ""), tok(".", ".", "")]
    phonemes = "həlˈO, dˈOnt."
    durations = torch.tensor([5] + [2] * len(phonemes) + [1])  # pads on both sides
    words = english_words(tokens, phonemes, durations)
    assert [w.text for w in words] == ["Hello,", "don't."]
    assert words[0].start < words[0].end <= words[1].start < words[1].end
    # the first word: where its first phoneme's frames start (after the 5-frame pad), less the lead
    assert ACOUSTIC_LEAD_FRAMES == 3 and words[0].start == pytest.approx((5 - 3) * FRAME_S)


def test_a_later_word_starts_at_its_first_phonemes_frames_not_in_the_space_before_it():
    """kokoro's join_timestamps starts "don't" in the middle of the 4-frame space (16 frames);
    its first phoneme 'd' starts at frame 5 + 6 * 2 + 4 = 21, so with the lead: 18."""
    tokens = [tok("Hello", "həlˈO", ""), tok(",", ","), tok("don't", "dˈOnt", ""), tok(".", ".", "")]
    phonemes = "həlˈO, dˈOnt."
    durations = torch.tensor([5] + [2] * 6 + [4] + [2] * 6 + [1])
    hello, dont = english_words(tokens, phonemes, durations)
    assert dont.start == pytest.approx((21 - 3) * FRAME_S)
    assert hello.end == pytest.approx((5 + 12 - 3) * FRAME_S)  # the comma's frames are the word's, not the space
    assert dont.end == pytest.approx((21 + 12 - 3) * FRAME_S)


def test_symbols_the_model_drops_do_not_shift_the_frames():
    # "X" is not in the model's vocabulary: the model never saw it, so it has no frames
    tokens = [tok("ab", "aXb"), tok("cd", "cd", "")]
    durations = torch.tensor([4, 2, 2, 3, 2, 2, 1])  # pad a b space c d pad
    ab, cd = english_words(tokens, "aXb cd", durations, kept=lambda c: c != "X")
    assert (ab.start, cd.start) == pytest.approx(((4 - 3) * FRAME_S, (4 + 4 + 3 - 3) * FRAME_S))


def test_espeak_groups_pair_one_to_one_with_the_words():
    words = phoneme_words("Hola, amigo mío.", "ˈola, amˈiɣo mˈio.", torch.tensor([3] + [2] * 18 + [1]))
    assert [w.text for w in words] == ["Hola,", "amigo", "mío."]
    assert all(a.end <= b.start for a, b in zip(words, words[1:]))


def test_a_number_spoken_as_several_groups_stays_one_word():
    text, phonemes = "Tengo 125 años.", "tˈɛŋɡo θjˈɛnto βˌAntiθˈinko ˈaɲos."
    spoken = {"Tengo": "tˈɛŋɡo", "125": "θjˈɛnto βˌAntiθˈinko", "años.": "ˈaɲos."}
    words = phoneme_words(text, phonemes, torch.tensor([3] + [2] * len(phonemes) + [1]), spoken.__getitem__)
    assert [w.text for w in words] == ["Tengo", "125", "años."]
    assert words[1].end - words[1].start > 2 * (words[0].end - words[0].start)  # both groups are the number's
    # without a way to phonemize one word the groups are spread by letters: every word still comes out
    spread = phoneme_words(text, phonemes, torch.tensor([3] + [2] * len(phonemes) + [1]))
    assert [w.text for w in spread] == ["Tengo", "125", "años."]


def test_place_moves_by_the_trimmed_samples_and_the_pieces_before_and_clamps():
    words = [TimedWord("a", 0.0, 0.1), TimedWord("b", 0.1, 5.0)]
    placed = place(words, SR, raw_offset=1200, piece_samples=6000, sentence_offset=10_000)
    assert placed == [WordTiming(text="a", start=10_000, end=11_200), WordTiming(text="b", start=11_200, end=16_000)]


def test_no_word_starts_before_the_piece_sounds_nor_ends_in_the_silence_after_it():
    """The trimmed piece keeps a margin of silence before its first sound (480 samples here):
    the first word starts where the sound does, not at the start of the margin."""
    words = [TimedWord("a", 0.0, 0.1), TimedWord("b", 0.1, 5.0)]
    placed = place(words, SR, raw_offset=1200, piece_samples=6000, sentence_offset=10_000, sound=(480, 5000))
    assert placed == [WordTiming(text="a", start=10_480, end=11_200), WordTiming(text="b", start=11_200, end=15_000)]


def test_heard_words_counts_a_word_in_progress():
    words = [WordTiming(text="one", start=0, end=100), WordTiming(text="two", start=100, end=200),
             WordTiming(text="three", start=200, end=300)]
    assert heard_words(words, 150) == (words[:2], words[2:])
    assert heard_words(words, 0) == ([], words)
    assert heard_words(words, 10**6) == (words, [])


def last_sentence(text: str, language: str) -> SynthesisRequest:
    """A turn's only sentence (its request's timestamps all 0)."""
    return SynthesisRequest(session_id="s", turn_id="t", agent_id="a", sentence_seq=0, text=text, language=language,
                            voice="af_heart", speed=1.0, is_last_in_turn=True, first_token_at_us=0,
                            text_complete_at_us=0, released_at_us=0)


def test_words_go_out_on_the_chunk_that_holds_their_start():
    job = SynthesisJob(last_sentence("x", "a"), received_at_us=1)
    chunk = 2400  # 100 ms
    assembler = ChunkAssembler(job, chunk_ms=100, sample_rate=SR)
    words = [WordTiming(text="a", start=0, end=2000), WordTiming(text="b", start=3000, end=5000),
             WordTiming(text="c", start=7500, end=9000)]
    out = assembler.feed(bytes(2 * chunk * 3), words[:2])  # two chunks out (one held back)
    out += assembler.feed(bytes(2 * chunk), words[2:])
    out += assembler.finish()
    assert [[w.text for w in c.words] for c in out] == [["a"], ["b"], [], ["c"]]
    codec = Codec()
    assert codec.decode(codec.encode("AudioChunk", out[1])).value["words"] == [{"text": "b", "start": 3000, "end": 5000}]


@pytest.mark.parametrize("text,language", [("Hello there, how are you doing on this fine day today?", "en"),
                                           ("Hola, tengo veinte años y vivo en Madrid.", "es")])
def test_the_engine_times_every_written_word_in_order_within_the_audio(tiny_engine, text, language):
    job = SynthesisJob(last_sentence(text, language), received_at_us=1)
    assembler = ChunkAssembler(job, chunk_ms=100, sample_rate=SR)
    chunks = []
    for timed in tiny_engine.stream_timed(chunk_ms=100, **synthesis_args(job)):
        chunks += assembler.feed(timed.pcm, timed.words)
    chunks += assembler.finish()
    words = [w for c in chunks for w in c.words]
    total = sum(len(c.pcm) for c in chunks) // 2
    assert [w.text for w in words] == text.split()
    starts = [w.start for w in words]
    assert starts == sorted(starts) and all(0 <= w.start <= w.end <= total for w in words)
    before = 0
    for c in chunks:  # each word rides on the chunk whose audio holds its start
        n = len(c.pcm) // 2
        assert all(before <= w.start < before + n or c.is_last_chunk for w in c.words)
        before += n
