"""What goes out of a synthesis job's audio: the engine's PCM16 stream cut into `AudioChunk`s of
``chunk_ms`` (`ChunkAssembler`), each encoded as the worker's audio format says, with the words
whose start it holds and the latency stamps of the request.

A pure core like the scheduler: no Kafka, no engine; the clock (epoch µs) is passed in.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

from voicebus.audio_codec import AudioFormat
from voicebus.clock import now_us
from voicebus.schemas.contract import AudioEncoding
from voicebus.schemas.messages import AudioChunk, WordTiming

if TYPE_CHECKING:
    from voicebus.synthesis.scheduler import SynthesisJob

BYTES_PER_SAMPLE = 2  # PCM16LE mono


class ChunkAssembler:
    """Cuts the PCM16 stream of one request into `AudioChunk`s of `chunk_ms`, each encoded as
    `audio` says (`voicebus.audio_codec`: PCM16 as is, or whole Opus packets, the chunk then
    rounded to whole frames; one encoder per request, flushed with its last audio).

    One full chunk is held back until more audio (or the end) arrives, so the last chunk of the
    sentence can carry ``is_last_chunk``. Where the engine pauses to decode more of the sentence
    (the end of a window or piece: ``feed(..., pause=True)``) nothing is held: the held chunk and
    the remainder go out at once (the remainder cut to whole Opus frames), since the audio after
    the pause is the sentence's end, not them; held, they left a player with one chunk to play
    while the next window decoded (bench ttfa: 40-100 ms of silence after a turn's first chunk).
    A remainder shorter than a quarter chunk is appended to the last chunk instead of going out
    as a tiny chunk of its own.

    Word timings fed with the audio (samples from the sentence's start) go out on the chunk
    whose audio holds the word's start, so a player has a word before it renders its start;
    a word starting beyond the audio fed so far waits for the chunk that holds it (the last
    chunk takes every word left)."""

    def __init__(self, job: SynthesisJob, *, chunk_ms: int, sample_rate: int, worker_id: str = "",
                 audio: AudioFormat | None = None, clock_us: Callable[[], int] = now_us) -> None:
        if chunk_ms <= 0:
            raise ValueError("chunk_ms must be positive")
        self.job = job
        self.sample_rate = sample_rate
        self.worker_id = worker_id
        self.audio = audio or AudioFormat(AudioEncoding.PCM16LE, sample_rate)
        if self.audio.sample_rate != sample_rate:
            raise ValueError(f"audio format at {self.audio.sample_rate} Hz for a {sample_rate} Hz engine")
        self.chunk_bytes = self.audio.chunk_bytes(chunk_ms)
        self._encoder = self.audio.encoder()
        self.clock_us = clock_us  # epoch µs: synthesis start and each chunk's audio ready
        self.synthesis_started_at_us = clock_us()
        self._last_ready_us: int | None = None  # when the audio fed last was ready
        self._fed_bytes = 0  # PCM fed so far
        self._buffer = bytearray()
        self._held: tuple[bytes, int] | None = None  # (pcm, audio_ready_at_us)
        self._next_seq = 0
        self._words: deque[WordTiming] = deque()  # timed words not yet on a chunk, by start
        self._built_samples = 0  # samples of the chunks built so far
        self.finished = False

    @property
    def fed_bytes(self) -> int:
        """PCM bytes of engine output fed so far (0: nothing of the sentence was made yet)."""
        return self._fed_bytes

    def feed(self, pcm: bytes, words: Iterable[Any] = (), pause: bool = False) -> list[AudioChunk]:
        """Add engine output (and the word timings that came with it: `WordTiming`s or their
        records); returns the chunks now ready to publish, in order. ``pause``: the engine decodes
        more of this sentence before its next output, so all that is whole goes out now."""
        if self.finished:
            raise RuntimeError("feed after finish")
        ready_at = self._last_ready_us = self.clock_us()
        for word in words:
            self._words.append(word if isinstance(word, WordTiming) else WordTiming.from_record(word))
        self._buffer += pcm
        self._fed_bytes += len(pcm)
        out: list[AudioChunk] = []
        while len(self._buffer) >= self.chunk_bytes:
            piece = bytes(self._buffer[: self.chunk_bytes])
            del self._buffer[: self.chunk_bytes]
            if self._held is not None:
                out.append(self._build(*self._held, last=False))
            self._held = (piece, ready_at)
        if pause:
            if self._held is not None:
                out.append(self._build(*self._held, last=False))
                self._held = None
            whole = len(self._buffer) - len(self._buffer) % self.audio.unit_bytes
            if whole >= self.chunk_bytes // 4:
                out.append(self._build(bytes(self._buffer[:whole]), ready_at, last=False))
                del self._buffer[:whole]
        return out

    @property
    def realtime_factor(self) -> float | None:
        """Seconds from synthesis start to the last audio fed, over the seconds of audio fed (None
        before any audio): above 1 the sentence was made slower than it plays."""
        if self._last_ready_us is None or self._fed_bytes < BYTES_PER_SAMPLE:
            return None
        audio_s = self._fed_bytes // BYTES_PER_SAMPLE / self.sample_rate
        return max(0, self._last_ready_us - self.synthesis_started_at_us) / 1e6 / audio_s

    def finish(self, end_reason: str = "") -> list[AudioChunk]:
        """The end of the sentence: the remaining chunk(s), the last flagged. A sentence with no
        audio at all (an end-of-turn marker) yields one empty last chunk.

        ``end_reason`` (not empty) says the sentence ends early, its audio incomplete: the audio
        made so far goes out and then one empty last chunk carrying the reason, so a player that
        keys chunks by sequence sees the sentence (and, for the turn's last sentence, the turn)
        end, and why."""
        if self.finished:
            return []
        self.finished = True
        ready_at = self.clock_us()
        rest = bytes(self._buffer[: len(self._buffer) - len(self._buffer) % BYTES_PER_SAMPLE])
        self._buffer.clear()
        out: list[AudioChunk] = []
        if end_reason:
            # the audio made so far ends here (an encoder is flushed with it), before the closing chunk
            if self._held is not None:
                out.append(self._build(self._held[0] + rest, self._held[1], last=False, audio_ends=True))
            elif rest:
                out.append(self._build(rest, ready_at, last=False, audio_ends=True))
            self._held = None
            out.append(self._build(b"", ready_at, last=True, end_reason=end_reason))
            return out
        if self._held is None:
            return [self._build(rest, ready_at, last=True)]
        held_pcm, held_at = self._held
        self._held = None
        if len(rest) < self.chunk_bytes // 4:
            return [self._build(held_pcm + rest, held_at, last=True)]
        out.append(self._build(held_pcm, held_at, last=False))
        out.append(self._build(rest, ready_at, last=True))
        return out

    def _build(self, pcm: bytes, ready_at_us: int, *, last: bool, end_reason: str = "",
               audio_ends: bool = False) -> AudioChunk:
        r = self.job.request
        # words are placed by the samples fed (PCM), whatever the encoding on the bus
        self._built_samples += len(pcm) // BYTES_PER_SAMPLE
        words = []
        while self._words and (last or self._words[0].start < self._built_samples):
            words.append(self._words.popleft())
        payload = self._encoder.encode(pcm, last=last or audio_ends)
        chunk = AudioChunk(
            session_id=r.session_id,
            turn_id=r.turn_id,
            sentence_seq=r.sentence_seq,
            chunk_seq=self._next_seq,
            is_last_chunk=last,
            is_last_in_turn=last and r.is_last_in_turn,
            sample_rate=self.sample_rate,
            encoding=self.audio.encoding,
            pcm=payload,
            worker_id=self.worker_id,
            first_token_at_us=r.first_token_at_us,
            text_complete_at_us=r.text_complete_at_us,
            released_at_us=r.released_at_us,
            request_received_at_us=self.job.received_at_us,
            synthesis_started_at_us=self.synthesis_started_at_us,
            audio_ready_at_us=ready_at_us,
            published_at_us=0,  # stamped by the shell just before sending
            end_reason=end_reason,
            words=tuple(words),
        )
        self._next_seq += 1
        return chunk


def chunk_duration_ms(chunk: AudioChunk) -> float:
    return len(chunk.pcm) / BYTES_PER_SAMPLE / chunk.sample_rate * 1000.0
