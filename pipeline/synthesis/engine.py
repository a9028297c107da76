"""The synthesis engine: text in, PCM16 24 kHz mono chunks out, with the real Kokoro-82M code.

This module owns one process's Kokoro model (`kokoro.KModel`, shared by every request), its
G2P per language (`voicebus.synthesis.g2p`, built lazily), the voice packs and their blends,
and the streaming of one sentence: cut into pieces (`voicebus.synthesis.pieces`), each piece
predicted, decoded (in windows where that brings the first audio sooner:
`voicebus.synthesis.kokoro_frames`), its silence trimmed (`voicebus.synthesis.pcm`) and its
words timed (`voicebus.synthesis.words`). It knows nothing about Kafka: the synthesis worker
calls `SynthesisEngine.stream` in a thread.

Weights come from `voicebus.synthesis.weights` (`SynthesisEngine.load`); `SynthesisEngine.tiny`
builds the same Kokoro code with a tiny random-weight config for fast, deterministic tests.

Size: about 700 lines, 500 of them the one `SynthesisEngine` class. Its streaming methods share
the model lock, the voice cache and the decode-speed estimate that windowed decoding plans
with; split apart, each would take all three as arguments. Everything without that state
lives in the modules named above.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple

from voicebus.schemas.contract import PHONEME_SPAN, VoiceMix, kokoro_code, parse_voice
from voicebus.synthesis.g2p import REPO_ID, build_g2p
from voicebus.synthesis.pcm import PartTrimmer, chunk_pcm, float_to_pcm16, sounding_span, trimmed
from voicebus.synthesis.pieces import piece_limits, split_for_early_audio
from voicebus.synthesis.words import TimedWord, WordTiming, english_words, phoneme_words, place

if TYPE_CHECKING:  # torch and kokoro are heavy: imported inside the functions that need them
    import torch

    from voicebus.settings import Settings
    from voicebus.synthesis.kokoro_frames import Frames

log = logging.getLogger(__name__)

SAMPLE_RATE = 24000

# A Kokoro phoneme sequence may hold at most 510 symbols (512 positions with the two pads).
MAX_PHONEMES = 510

# torch intra-op threads of a process that loads the real model: `Settings.synthesis_threads`.
# On this project's 2-core machine, shared with the broker, gate, edge and other workers, 2
# threads made a forward pass 3-4x *slower* than 1 (OpenMP threads waiting at every op's barrier
# for a core another process holds); on the same machine quiet, 2 were 1.6x faster
# (`voicebus bench synth`, docs/benchmarks.md). Hence 1 by default, and a setting.


def intra_op_threads(settings: Settings) -> int:
    """The torch intra-op threads of a worker (`Settings.synthesis_threads`, at least 1)."""
    if settings.synthesis_threads < 1:
        raise EngineError(f"synthesis_threads is {settings.synthesis_threads}: a worker needs at least 1 thread")
    return settings.synthesis_threads


# Voice mixes (`voicebus.schemas.contract.parse_voice`) are blended once and kept: the most
# recently used ones, each a [510, 1, 256] float32 tensor (522 KB).
VOICE_MIX_CACHE = 16


class EngineError(RuntimeError):
    """Base class of synthesis engine errors."""


class NoVoices(EngineError):
    """The engine has no voice pack at all."""


def pick_device(requested: str) -> str:
    """``auto`` gives cuda when available, else cpu; ``cuda`` when unavailable is an error."""
    import torch

    requested = (requested or "auto").lower()
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' requested but torch sees no CUDA device")
    if requested not in {"cpu", "cuda"} and not requested.startswith("cuda:"):
        raise EngineError(f"unknown device {requested!r}: use auto, cpu or cuda")
    return requested


PRECISIONS = ("auto", "float32", "bfloat16")


# The /proc/cpuinfo flags of a CPU that multiplies bfloat16 in hardware: Intel's AMX tiles, or
# AVX-512's bfloat16 dot product (AMD Zen 4/5, Intel Cooper Lake and later). Without either,
# oneDNN emulates bfloat16 and the generator is ~6x slower than in float32 (an AVX2-only EPYC).
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU multiplies bfloat16 in hardware (a flag of `BF16_CPU_FLAGS`):
    oneDNN's bfloat16 convolutions are then faster than its float32 ones: ~8x with AMX; with AVX-512
    BF16 on a 2-core Zen 5 EPYC, synthesis's real-time factor 1.7x lower and its first audio 1.4x
    sooner (docs/benchmarks.md, "bench synth")."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and BF16_CPU_FLAGS & set(line.split()) for line in f)
    except OSError:  # not Linux: never assumed
        return False


def pick_precision(requested: str, device: str, cpu_bf16: Callable[[], bool] = cpu_has_bf16) -> "torch.dtype":
    """The folded decoder's dtype (`Settings.synthesis_precision`): ``auto`` gives bfloat16 on a
    CPU that multiplies it in hardware (`cpu_has_bf16`; Whisper hears the same words; docs/worker.md,
    "The generator, folded") and float32 elsewhere (a GPU's bfloat16 is not measured yet)."""
    import torch

    requested = (requested or "auto").lower()
    if requested not in PRECISIONS:
        raise EngineError(f"unknown synthesis precision {requested!r}: use {', '.join(PRECISIONS)}")
    if requested == "auto":
        return torch.bfloat16 if device == "cpu" and cpu_bf16() else torch.float32
    return torch.bfloat16 if requested == "bfloat16" else torch.float32


def folded_decoder(model, precision: "torch.dtype") -> tuple:
    """The engine's (generator, frame-rate half, PL-BERT or None) for a loaded model in
    ``precision``: folded (`kokoro_frames.FoldedGenerator`, `FoldedFrameRateHalf`), PL-BERT in
    bfloat16 too where the decoder is; in float32 on a CPU the generator's wide convolutions
    through short DFTs and the 3-tap ones of many channels through F(4, 3)
    (`voicebus.synthesis.tiled_conv`: fewer multiplications, the same audio), and PL-BERT's
    linear layers prepacked (`kokoro_frames.PrepackedBert`)."""
    import torch

    from voicebus.synthesis import kokoro_frames, torch_ops

    bert = None
    if precision == torch.bfloat16:
        bert = kokoro_frames.Bfloat16Bert(model, precision)
    elif model.device.type == "cpu":
        try:
            bert = kokoro_frames.PrepackedBert(model)
        except torch_ops.TorchInternalsMissing as exc:
            log.warning("PL-BERT runs as kokoro's own, unpacked: %s", exc)
    return (kokoro_frames.FoldedGenerator(model, precision, tiled=True),
            kokoro_frames.FoldedFrameRateHalf(model, precision, tiled=True), bert)


def noise_drawer(model) -> "Callable | None":
    """What draws the harmonic source's noise (`kokoro_frames.harmonic_source`) for a loaded
    model: `torch_ops.randn_like_strided` on a CPU (torch's values, less than half the time),
    where the installed torch draws as it expects; None: kokoro's own ``m_source`` (on CUDA,
    or logged: the torch it found)."""
    from voicebus.synthesis import torch_ops

    if model.device.type != "cpu":
        return None
    try:
        torch_ops.check_randn_like_strided()
    except torch_ops.TorchInternalsMissing as exc:
        log.warning("the harmonic source's noise is drawn as kokoro draws it: %s", exc)
        return None
    return torch_ops.randn_like_strided


# A phoneme alphabet for the tiny random-weight model (the real one comes with the weights).
_TINY_SYMBOLS = (
    ";:,.!?—…\"()“” "
    "abcdefhijklmnopqrstuvwxyzAIOQSTWY"
    "ɑɐɒæβɔɕçɖðʤəɚɛɜɟɡɥɨɪʝɯɰŋɳɲɴøɸθœɹɾɻʁɽʂʃʈʧʊʋʌɣɤχʎʒʔˈˌːʰʲ↓→↗↘ᵻ"
)


def tiny_config() -> dict:
    """The real Kokoro-82M architecture with everything that can shrink shrunk: ALBERT hidden
    32 with one layer, one predictor/text-encoder layer, max_dur 4. ``hidden_dim`` 512,
    ``style_dim`` 128 and the decoder's channels are fixed by the kokoro code: the decoder
    costs what the real one does per frame. Random weights give a token about half of
    ``max_dur``: 2 frames, a fast speaker (the released model: about 3.5), so tests and demos
    decode short audio."""
    from voicebus.synthesis.weights import KOKORO_CONFIG

    vocab = {s: i + 1 for i, s in enumerate(dict.fromkeys(_TINY_SYMBOLS))}
    shrunk_albert = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
                     "num_hidden_layers": 1, "embedding_size": 16}
    return {**KOKORO_CONFIG, "max_dur": 4, "n_layer": 1,
            "plbert": {**KOKORO_CONFIG["plbert"], **shrunk_albert}, "vocab": vocab}


TINY_VOICES = ("af_heart", "am_tiny", "ef_tiny", "pf_tiny")


class Piece(NamedTuple):
    """One forward pass's input: its phonemes, and how its words are timed from the durations
    the model predicts for them (`voicebus.synthesis.words`); English pieces also carry
    misaki's tokens (benchmarks compare other alignments of them)."""

    phonemes: str
    time_words: Callable[["torch.Tensor"], list[TimedWord]]
    tokens: list | None = None


class Voiced(NamedTuple):
    """One forward pass's output: PCM16LE, the samples of the raw output cut before it (silence
    trimming, frames not decoded) and the predicted frames per phoneme token."""

    pcm: bytes
    raw_offset: int
    durations: "torch.Tensor"


class VoicedPart(NamedTuple):
    """One part of a piece's audio as it is decoded (`SynthesisEngine.voice_parts`): PCM16LE
    to publish, and what word timing needs (the same on every part): the samples of the raw
    output cut before the piece's PCM (known from the first part with audio), the predicted
    frames per token, an upper bound of the piece's published samples, and where its sound is
    predicted to end (samples of its published audio; before the piece is decoded: the end of
    the last frame whose predicted energy is above `kokoro_frames.SOUND_ENERGY_THRESHOLD`;
    None for a piece decoded in one part, whose sound is measured on its audio)."""

    pcm: bytes
    raw_offset: int
    durations: "torch.Tensor"
    bound: int
    sound_end: int | None = None
    final: bool = True  # the piece's last part: False while windows of it remain to be decoded


class TimedChunk(NamedTuple):
    """A chunk of `SynthesisEngine.stream_timed`: PCM16LE, and on the first chunk of each piece
    the piece's words in samples from the start of the sentence (empty on the others).
    ``pause``: the last chunk before the engine decodes more of this sentence (the next window
    or piece): all of the sentence's audio so far can go out, none of it is the last."""

    pcm: bytes
    words: list[WordTiming]
    pause: bool = False


class SpokenPiece(NamedTuple):
    """One piece of a sentence as spoken (with windowed decoding: one window of it): its input,
    its audio, its words in samples of the sentence (on a piece's first part only), and the
    samples of the sentence before it."""

    piece: Piece
    voiced: Voiced
    words: list[WordTiming]
    offset: int
    more: bool = False  # more of this sentence follows, after another forward pass or window


@dataclass
class SynthesisEngine:
    """One Kokoro model shared by all requests of a process; `stream` is blocking and
    thread-safe (forward passes are serialized by a lock, which also keeps seeding exact)."""

    model: object  # kokoro.KModel, in eval mode, on `device`
    voice_packs: dict  # name -> FloatTensor [510, 1, 256]
    device: str
    source: str = "unknown"
    """Where the weights came from (``tiny``, ``local``, ``hub``, ``offline-pack``)."""
    fallback_voice: str | None = None
    """The voice used when a requested one is not available (warned about once per name): a name
    in ``voice_packs``, or a mix of them (`resolve_voice`)."""
    seed: int | None = None
    """When set, torch is seeded before each forward pass: output is then deterministic."""
    sample_rate: int = SAMPLE_RATE
    silence_margins_ms: tuple[int, int] | None = None
    """Silence kept before and after each piece's sound (`trim_silence`); None keeps the
    model's padding as it is (the tiny test model's output is noise, never trimmed)."""
    decode_sound_only: bool = True
    """With ``silence_margins_ms`` set: the decoder gets only the frames around the predicted
    sound (`kokoro_frames.sound_span`), not the silence that trimming would throw away."""
    windowed: bool = False
    """With sound-only decoding: the decoder's generator runs in windows of frames, the first
    short, and each window's audio is published as soon as it is decoded
    (`kokoro_frames.decode_windows`, docs/worker.md "First audio from the first window").
    `Settings.windowed_decoding`, on by default since its quality gates hold."""
    generator: "Callable | None" = field(default=None, repr=False)
    """What decodes the generator's windows: `kokoro_frames.FoldedGenerator` in the engine's
    precision (`load`, `tiny`); None: kokoro's own generator (`kokoro_frames.generate`)."""
    frame_rate_half: "Callable | None" = field(default=None, repr=False)
    """What computes the decoder's frame-rate half: `kokoro_frames.FoldedFrameRateHalf` in the
    engine's precision (`load`, `tiny`); None: kokoro's own."""
    randn_like: "Callable | None" = field(default=None, repr=False)
    """What draws the harmonic source's noise (`noise_drawer`: `torch_ops.randn_like_strided` on a
    CPU, `load`, `tiny`); None: kokoro's own ``m_source``. The same values either way."""
    bert: "Callable | None" = field(default=None, repr=False)
    """What encodes the phonemes for prediction: `kokoro_frames.Bfloat16Bert` where the engine's
    precision is bfloat16, `kokoro_frames.PrepackedBert` in float32 on a CPU (`load`); None:
    kokoro's own, in float32."""
    inner_pause_frames: int | None = None
    """With sound-only decoding: the frames of predicted silence kept at most inside a phrase
    (`kokoro_frames.shorten_inner_silence`, before anything is decoded); None: Kokoro's own
    pauses. `Settings.shorten_inner_pauses` (`load`: `kokoro_frames.MAX_INNER_SILENCE_FRAMES`)."""
    grad_mode: str = "inference"
    """``inference`` (`torch.inference_mode`) or ``no_grad``, for the forward passes."""
    adaptive_windows: bool = True
    """With windowed decoding: window sizes from the decode speed measured here
    (`kokoro_frames.first_cut`, `next_cut`: each window arrives before the player runs out of
    the audio before it); False: the fixed sizes of `kokoro_frames.seams`."""
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    """Seconds, for the decode speed and the audio ahead of the player (injected in tests)."""
    decode_s_per_frame: float | None = field(default=None, repr=False)
    """The generator's seconds per decoded frame on this machine, as last measured (a moving
    average over windows; None until a window has been decoded)."""
    last_decoded_frames: tuple[int, int] | None = field(default=None, repr=False)
    """(frames decoded, frames predicted) of the latest `_decode_sound` (benchmarks, tests)."""
    last_seams: list[int] = field(default_factory=list, repr=False)
    """Frames (of the piece's predicted frames) where the latest `voice_parts` crossfaded two
    windows (benchmarks, tests)."""
    _g2p: dict = field(default_factory=dict, repr=False)
    _warned_voices: set = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _mixes: OrderedDict = field(default_factory=OrderedDict, repr=False)  # canonical spec -> blended pack
    _mixes_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, settings: "Settings", bake_weight_norms: bool = True, folded: bool = True) -> "SynthesisEngine":
        """The real Kokoro-82M, weights resolved by `voicebus.synthesis.weights`; its weight
        norms baked (`kokoro_frames.bake_weight_norms`) unless ``bake_weight_norms`` is False,
        its decoder folded (`kokoro_frames.FoldedGenerator`, `FoldedFrameRateHalf`, in `Settings.synthesis_precision`)
        unless ``folded`` is False (both False: the engine as it was, for `voicebus bench synth`'s
        A/B)."""
        from voicebus.synthesis.weights import fallback_voice, load_voice_packs, resolve_weights

        import torch
        from kokoro import KModel

        device = pick_device(settings.device)
        resolved = resolve_weights(settings)
        model = KModel(repo_id=REPO_ID, config=str(resolved.config_path), model=str(resolved.model_path))
        model = model.to(device).eval()
        from voicebus.synthesis import kokoro_frames

        kokoro_frames.check_kokoro_internals(model)
        if bake_weight_norms:
            kokoro_frames.bake_weight_norms(model)
        voices = load_voice_packs(resolved.voices_dir)
        if not voices:
            raise NoVoices(f"no voice packs in {resolved.voices_dir}")
        fallback = fallback_voice(settings.default_voice, voices)
        torch.set_grad_enabled(False)
        torch.set_num_threads(intra_op_threads(settings))
        precision = pick_precision(settings.synthesis_precision, device)
        generator, half, bert = folded_decoder(model, precision) if folded else (None, None, None)
        return cls(
            model=model, voice_packs=voices, device=device, source=resolved.source, fallback_voice=fallback,
            silence_margins_ms=(settings.max_lead_silence_ms, settings.max_trail_silence_ms),
            windowed=settings.windowed_decoding, generator=generator, frame_rate_half=half, bert=bert,
            randn_like=noise_drawer(model) if folded else None,
            inner_pause_frames=kokoro_frames.MAX_INNER_SILENCE_FRAMES if settings.shorten_inner_pauses else None,
        )

    @classmethod
    def tiny(cls, seed: int = 0, device: str = "cpu") -> "SynthesisEngine":
        """Real kokoro code with a tiny random-weight config and random voice packs."""
        import torch
        from kokoro import KModel

        empty_state = io.BytesIO()
        torch.save({}, empty_state)  # KModel always loads a state dict; an empty one keeps the init
        empty_state.seek(0)
        torch.manual_seed(seed)
        model = KModel(repo_id=REPO_ID, config=tiny_config(), model=empty_state).to(device).eval()
        from voicebus.synthesis.kokoro_frames import FoldedFrameRateHalf, FoldedGenerator, bake_weight_norms

        bake_weight_norms(model)
        noise = torch.Generator().manual_seed(seed)
        voices = {name: torch.randn(510, 1, 256, generator=noise) * 0.5 for name in TINY_VOICES}
        return cls(model=model, voice_packs=voices, device=device, source="tiny", fallback_voice=TINY_VOICES[0], seed=seed,
                   generator=FoldedGenerator(model), frame_rate_half=FoldedFrameRateHalf(model), randn_like=noise_drawer(model))

    # --- queries --------------------------------------------------------------------------------

    @property
    def voices(self) -> list[str]:
        return sorted(self.voice_packs)

    def resolve_voice(self, voice: str) -> str:
        """The voice actually used for ``voice``, in its canonical spelling (a name, or a mix:
        `voicebus.schemas.contract.parse_voice`).

        A voice pack of that name, or a mix whose voices are all here: itself. A mix with some of
        its voices missing: the mix of the others, their weights renormalized (each missing
        voice warned about once). A name, or a mix, with none of its voices here (or no voice
        at all): the fallback voice, warned about once. Without a fallback voice (a strict
        engine) any missing voice is `NoVoices`. A non-empty ``voice`` that is no voice spec
        is `voicebus.schemas.contract.InvalidVoice` (the contract refuses it on the bus, so a
        worker never gets one)."""
        if voice in self.voice_packs:
            return voice
        mix = parse_voice(voice) if voice and voice.strip() else None
        if mix is not None and mix.single in self.voice_packs:
            return mix.single
        here = [(name, weight) for name, weight in mix.parts if name in self.voice_packs] if mix else []
        if mix is not None and len(here) == len(mix.parts):
            return mix.canonical
        if self.fallback_voice is None:
            raise NoVoices(f"voice {voice!r} is not available and there is no fallback voice")
        if here:
            for name in mix.names:
                if name not in self.voice_packs and name not in self._warned_voices:
                    self._warned_voices.add(name)
                    log.warning("voice %r is not available (have %s); the mixes with it are spoken without it",
                                name, ", ".join(self.voices))
            return VoiceMix.of(here).canonical
        if voice not in self._warned_voices:
            self._warned_voices.add(voice)
            log.warning("voice %r is not available (have %s); using %r", voice, ", ".join(self.voices), self.fallback_voice)
        return self.fallback_voice

    def voice_pack(self, voice: str) -> "torch.Tensor":
        """The style tensor [510, 1, 256] for ``voice`` as `resolve_voice` resolves it: a voice
        pack, or the weighted sum of its voices' packs for a mix (blended once, then kept among
        the `VOICE_MIX_CACHE` most recently used, by canonical spelling)."""
        used = self.resolve_voice(voice)
        pack = self.voice_packs.get(used)
        if pack is not None:
            return pack
        with self._mixes_lock:
            pack = self._mixes.get(used)
            if pack is not None:
                self._mixes.move_to_end(used)
                return pack
        parts = parse_voice(used).parts
        pack = parts[0][1] * self.voice_packs[parts[0][0]]
        for name, weight in parts[1:]:
            pack = pack + weight * self.voice_packs[name]
        with self._mixes_lock:
            self._mixes[used] = pack
            self._mixes.move_to_end(used)
            while len(self._mixes) > VOICE_MIX_CACHE:
                self._mixes.popitem(last=False)
        return pack

    def phonemize(self, text: str, language: str) -> list[str]:
        """Phoneme strings (each at most 510 symbols) for ``text`` in ``language``."""
        return [p.phonemes for p in self.pieces(text, language)]

    def pieces(self, text: str, language: str) -> list[Piece]:
        """`phonemize`, each phoneme string with the timing of its words: English from misaki's
        tokens, the other languages from the phoneme groups (`voicebus.synthesis.words`; Japanese
        and Chinese, written without spaces, as one word)."""
        code = kokoro_code(language, default=None)
        pipeline = self._pipeline(code)
        if code not in "ab" and "[" in text and PHONEME_SPAN.search(text):
            return self._spliced_pieces(text, pipeline)
        out = []
        for result in pipeline(text, voice=None, split_pattern=None):
            phonemes = result.phonemes[:MAX_PHONEMES]
            if not phonemes:
                continue
            kept = self.model.vocab.__contains__  # what `kokoro_frames.token_ids` keeps
            if result.tokens is not None:
                timer = (lambda tokens, p: lambda d: english_words(tokens, p, d, kept))(result.tokens, phonemes)
            else:
                timer = (lambda g, p: lambda d: phoneme_words(g, p, d, lambda w: pipeline.g2p(w)[0], kept))(
                    result.graphemes, phonemes)
            out.append(Piece(phonemes, timer, result.tokens))
        return out

    def _spliced_pieces(self, text: str, pipeline) -> list[Piece]:
        """`pieces` of a text in a language other than English with inline phoneme spans: espeak
        (es, fr, hi, it, pt) and misaki's Japanese and Chinese G2P read ``[text](/phonemes/)`` as
        written (misaki's English G2P applies it itself). The text between spans is phonemized
        as usual, each span's phonemes are put in its place, and the span is one word of the
        timing, its written text."""
        from misaki.token import MToken

        from voicebus.synthesis.words import _group, _pair, time_tokens

        phonemize = lambda w: pipeline.g2p(w)[0]  # noqa: E731
        # Japanese and Chinese are written without spaces; their G2P puts one between words, so
        # a span is a word of its own there, spaced from the phonemes around it
        unspaced = pipeline.lang_code in "jz"
        parts: list[tuple[str, str, bool]] = []  # (written words, phonemes, space before)
        tokens: list = []
        at = 0

        def plain(chunk: str) -> None:
            if not chunk.strip():
                return
            phonemes = (phonemize(chunk.strip()) or "").strip()
            words = chunk.split()
            paired = _pair(words, [g for g in phonemes.split(" ") if g], phonemize)
            for word, groups in zip(words, paired):
                for k, group in enumerate(groups or [""]):
                    tokens.append(MToken(text=word if k == 0 else "", tag="X", whitespace="", phonemes=group))
                tokens[-1].whitespace = " "
            parts.append((chunk, phonemes, chunk[:1].isspace() or unspaced))
            if not chunk[-1:].isspace() and tokens:
                tokens[-1].whitespace = ""  # glued to the span after it: one written word

        for m in PHONEME_SPAN.finditer(text):
            plain(text[at:m.start()])
            label, phonemes = " ".join(m.group(1).split()), " ".join(m.group(2).split())
            before = m.start() == 0 or text[m.start() - 1].isspace() or unspaced
            parts.append((label, phonemes, before))
            glued = m.end() < len(text) and not text[m.end()].isspace()  # "[SQL](/.../)s": one word
            tokens.append(MToken(text=label, tag="X", whitespace="" if glued else " ", phonemes=phonemes))
            at = m.end()
        plain(text[at:])
        spoken = ""
        for _, phonemes, space_before in parts:
            if phonemes:
                spoken += (" " if spoken and space_before else "") + phonemes
        spoken = spoken[:MAX_PHONEMES]
        if not spoken:
            return []
        kept = self.model.vocab.__contains__

        def timer(durations, tokens=tokens, spoken=spoken):
            time_tokens(tokens, spoken, durations, kept)
            return _group(tokens)

        return [Piece(spoken, timer, None)]

    # --- synthesis ------------------------------------------------------------------------------

    def synthesize(self, phonemes: str, voice: str, speed: float = 1.0) -> bytes:
        """One forward pass: a phoneme string to PCM16 bytes, its silence cut to the margins
        (when ``silence_margins_ms`` is set) without decoding the silence that is cut."""
        return self.synthesize_timed(phonemes, voice, speed).pcm

    def synthesize_timed(self, phonemes: str, voice: str, speed: float = 1.0) -> Voiced:
        """`synthesize`, with what word timing needs: the samples cut before the PCM and the
        predicted durations."""
        import torch

        pack = self.voice_pack(voice)
        phonemes = phonemes[:MAX_PHONEMES]
        ref_s = pack[len(phonemes) - 1].to(self.device)
        grad_off = torch.no_grad() if self.grad_mode == "no_grad" else torch.inference_mode()
        with self._lock, grad_off:
            if self.seed is not None:
                torch.manual_seed(self.seed)
            if self.silence_margins_ms is None or not self.decode_sound_only:
                output = self.model(phonemes, ref_s, speed, return_output=True)
                pcm, offset = self._trimmed(float_to_pcm16(output.audio))
                return Voiced(pcm, offset, output.pred_dur)
            return self._decode_sound(phonemes, ref_s, speed)

    def _decode_sound(self, phonemes: str, ref_s: "torch.Tensor", speed: float) -> Voiced:
        """Kokoro's prediction for the whole piece, the decoder on its sounding frames only
        (docs/worker.md, "No compute on silence"). Called with the lock held."""
        from voicebus.synthesis import kokoro_frames

        lead_ms, trail_ms = self.silence_margins_ms
        frames = self._predict(phonemes, ref_s, speed)
        lead_frames = -(-max(0, lead_ms) * self.sample_rate // 1000 // kokoro_frames.SAMPLES_PER_FRAME)
        audio, start, stop = kokoro_frames.decode_sound(self.model, frames, lead=max(kokoro_frames.CONTEXT_FRAMES, lead_frames),
                                                        generator=self.generator, half=self.frame_rate_half,
                                                        randn_like=self.randn_like)
        self.last_decoded_frames = (stop - start, frames.count)
        pcm = float_to_pcm16(audio)
        undecoded_trail = (frames.count - stop) * kokoro_frames.SAMPLES_PER_FRAME
        per_ms = self.sample_rate // 1000
        pcm, cut = trimmed(pcm, per_ms * lead_ms, per_ms * trail_ms, undecoded_trail_samples=undecoded_trail)
        return Voiced(pcm, start * kokoro_frames.SAMPLES_PER_FRAME + cut, frames.durations)

    def _predict(self, phonemes: str, ref_s: "torch.Tensor", speed: float) -> "Frames":
        """Kokoro's prediction for the whole piece, its silences inside a phrase shortened to
        ``inner_pause_frames`` (docs/worker.md, "Mid-phrase pauses"). Called with the lock held."""
        from voicebus.synthesis import kokoro_frames

        frames = kokoro_frames.predict_frames(self.model, phonemes, ref_s, speed, bert=self.bert)
        if self.inner_pause_frames is None:
            return frames
        return kokoro_frames.shorten_inner_silence(frames, kokoro_frames.token_symbols(self.model, phonemes), self.inner_pause_frames)

    @property
    def windows_decoding(self) -> bool:
        """Whether `voice_parts` decodes in windows (then sentences are cut only where they must)."""
        return self.silence_margins_ms is not None and self.decode_sound_only and self.windowed

    def voice_parts(self, phonemes: str, voice: str, speed: float = 1.0) -> Iterator[VoicedPart]:
        """`synthesize_timed` in parts: with windowed, sound-only decoding, one part per window
        of frames as soon as it is decoded (the first after the prediction, the decoder's
        frame-rate half and the first window's generator); otherwise one part. The lock is
        held for each step, not across a yield: a consumer that stops iterating stops the
        decoding, and other requests' forward passes may run between two windows."""
        import torch

        from voicebus.synthesis import kokoro_frames as kf

        if not self.windows_decoding:
            voiced = self.synthesize_timed(phonemes, voice, speed)
            yield VoicedPart(voiced.pcm, voiced.raw_offset, voiced.durations, len(voiced.pcm) // 2)
            return
        pack = self.voice_pack(voice)
        phonemes = phonemes[:MAX_PHONEMES]
        ref_s = pack[len(phonemes) - 1].to(self.device)

        def grad_off():
            return torch.no_grad() if self.grad_mode == "no_grad" else torch.inference_mode()

        lead_ms, trail_ms = self.silence_margins_ms
        per_ms = self.sample_rate // 1000
        with self._lock, grad_off():
            if self.seed is not None:
                torch.manual_seed(self.seed)
            frames = self._predict(phonemes, ref_s, speed)
            energy = frames.frame_energy()
            lead_frames = -(-max(0, lead_ms) * self.sample_rate // 1000 // kf.SAMPLES_PER_FRAME)
            lead = max(kf.CONTEXT_FRAMES, lead_frames)
            start, stop = kf.sound_span(energy, lead=lead)
            whole = (start, stop) == (0, frames.count)
            weights = None if whole else kf.stand_in_weights(start, stop, frames.count, lead, kf.CONTEXT_FRAMES)
            prepared = kf.prepare_decoder(self.model, frames, start, stop, weights, self.frame_rate_half, self.randn_like)
            self.last_decoded_frames = (stop - start, frames.count)
            self.last_seams = []
        undecoded = (frames.count - stop) * kf.SAMPLES_PER_FRAME
        trimmer = PartTrimmer(per_ms * lead_ms, per_ms * trail_ms, undecoded_trail_samples=undecoded)
        span_samples = prepared.count * kf.SAMPLES_PER_FRAME
        count = prepared.count
        quiet = prepared.silent[0]  # the span's lead silence, which the first window holds before its sounding frames
        fixed = None if self.adaptive_windows else [*kf.seams(count, lead=quiet), count]
        window = {"lo": 0, "hi": 0}
        published = {"s": 0.0, "since": None}  # audio yielded, and when the first of it was

        def plan(lo: int) -> int:
            if fixed is not None:
                hi = next(end for end in fixed if end > lo)
            elif lo == 0:
                hi = kf.first_cut(count, quiet, self.decode_s_per_frame)
            else:
                played = 0.0 if published["since"] is None else self.clock() - published["since"]
                ahead = published["s"] - played
                hi = kf.next_cut(lo, count, ahead, self.decode_s_per_frame)
            window.update(lo=lo, hi=hi)
            if hi < count:
                self.last_seams.append(start + hi)
            return hi

        parts = kf.decode_windows(self.model, prepared, plan, self.generator)
        while True:
            with self._lock, grad_off():
                began = self.clock()
                audio = next(parts, None)
                took = self.clock() - began
            if audio is None:
                return
            # the speed the plan needs: the generator's seconds per frame it decodes, overhead included
            decoded = window["hi"] - window["lo"] + (kf.window_overhead() if window["lo"] else kf.SEAM_CONTEXT_FRAMES)
            speed = took / max(1, decoded)
            self.decode_s_per_frame = speed if self.decode_s_per_frame is None else 0.5 * (self.decode_s_per_frame + speed)
            last = window["hi"] >= count
            pcm = trimmer.feed(float_to_pcm16(audio), last=last)
            bound = span_samples - trimmer.cut + min(undecoded, per_ms * trail_ms)
            sound_end = min(bound, (prepared.count - prepared.silent[1]) * kf.SAMPLES_PER_FRAME - trimmer.cut)
            if published["since"] is None and pcm:
                published["since"] = self.clock()
            published["s"] += len(pcm) / 2 / self.sample_rate
            yield VoicedPart(pcm, start * kf.SAMPLES_PER_FRAME + trimmer.cut, frames.durations, bound,
                             sound_end if prepared.silent != (0, 0) else bound, final=last)
            if last:
                return

    def stream(
        self,
        text: str,
        language: str,
        voice: str,
        speed: float = 1.0,
        chunk_ms: int = 150,
        should_stop: Callable[[], bool] = lambda: False,
        first_clause_min_words: int = 0,
    ) -> Iterator[bytes]:
        """PCM16LE mono chunks of about ``chunk_ms`` for one sentence, the first as early as
        possible. Blocking: run it in a thread. ``should_stop`` is checked before each piece is
        synthesized and before each chunk is yielded; once it returns true nothing more comes."""
        for chunk in self.stream_timed(text, language, voice, speed, chunk_ms, should_stop, first_clause_min_words):
            yield chunk.pcm

    def stream_timed(
        self,
        text: str,
        language: str,
        voice: str,
        speed: float = 1.0,
        chunk_ms: int = 150,
        should_stop: Callable[[], bool] = lambda: False,
        first_clause_min_words: int = 0,
    ) -> Iterator[TimedChunk]:
        """`stream`, each piece's first chunk carrying the piece's words (`TimedChunk`): their
        start and end in samples from the start of this sentence's audio."""
        chunk_samples = max(1, self.sample_rate * chunk_ms // 1000)
        for spoken_piece in self.spoken_pieces(text, language, voice, speed, should_stop, first_clause_min_words):
            chunks = chunk_pcm(spoken_piece.voiced.pcm, chunk_samples)
            for i, chunk in enumerate(chunks):
                if should_stop():
                    return
                yield TimedChunk(chunk, spoken_piece.words if i == 0 else [], spoken_piece.more and i == len(chunks) - 1)

    def spoken_pieces(
        self,
        text: str,
        language: str,
        voice: str,
        speed: float = 1.0,
        should_stop: Callable[[], bool] = lambda: False,
        first_clause_min_words: int = 0,
    ) -> Iterator["SpokenPiece"]:
        """Each forward pass of one sentence as `stream_timed` speaks it: the piece, its audio and
        its words in samples of the sentence (`SpokenPiece`). With windowed decoding, one per
        decoded window of a piece, as soon as it is decoded; the piece's words come with its first."""
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        spoken = 0  # samples of this sentence before the current piece
        first_max, rest_max = piece_limits(self.windows_decoding)
        text_pieces = split_for_early_audio(text, first_max, rest_max, first_clause_min_words)
        for t, text_piece in enumerate(text_pieces):
            if should_stop():
                return
            pieces = self.pieces(text_piece, language)
            for p, piece in enumerate(pieces):
                if should_stop():
                    return
                later_pieces = t < len(text_pieces) - 1 or p < len(pieces) - 1
                words = None  # placed with the piece's first audio
                samples = 0
                for part in self.voice_parts(piece.phonemes, voice, speed):
                    if not part.pcm:
                        continue
                    first = words is None
                    if first:
                        # no word before the piece's audio sounds, nor after it; a first window
                        # does not know where the piece's sound ends: its predicted end is the limit
                        sound = sounding_span(part.pcm)
                        if self.windows_decoding:
                            sound = (sound[0], part.bound if part.sound_end is None else part.sound_end)
                        words = place(piece.time_words(part.durations), self.sample_rate, part.raw_offset, part.bound,
                                      spoken, sound=sound)
                    yield SpokenPiece(piece, Voiced(part.pcm, part.raw_offset, part.durations),
                                      words if first else [], spoken + samples, later_pieces or not part.final)
                    samples += len(part.pcm) // 2
                    if should_stop():
                        return
                spoken += samples

    def _trimmed(self, pcm: bytes) -> tuple[bytes, int]:
        if self.silence_margins_ms is None:
            return pcm, 0
        lead_ms, trail_ms = self.silence_margins_ms
        return trimmed(pcm, self.sample_rate * lead_ms // 1000, self.sample_rate * trail_ms // 1000)

    def _pipeline(self, lang_code: str):
        with self._lock:
            pipeline = self._g2p.get(lang_code)
            if pipeline is None:
                pipeline = self._g2p[lang_code] = build_g2p(lang_code)
            return pipeline
