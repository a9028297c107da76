"""What the demo's three modes (batch, console, LLM) share: the engine they load, how their
`PipelineStack` is started and where a turn's audio is written."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from voicebus.settings import Settings


def wav_path(out: Path, conversation: str, turn_id: str) -> Path:
    """Where the demo writes a turn's audio: ``<out>/<conversation>/<turn_id>.wav``. Both names come
    from data (a conversation's name, a turn id in its file): each is made one safe file-name
    component (`voicebus.paths.safe_name`), so no name leaves `out`."""
    from voicebus.paths import path_under

    return path_under(out, conversation.removesuffix(".jsonl"), turn_id, suffix=".wav")


def stack_options(args: argparse.Namespace) -> dict[str, Any]:
    """`voicebus.ops.runtime.PipelineStack` options from the demo's command line: no broker
    started when ``--bootstrap`` was given (that one is used), and the gate process logs at
    ``--log-level``."""
    return {"start_broker": getattr(args, "bootstrap", None) is None,
            "gate_log_level": getattr(args, "log_level", None) or "WARNING"}


def load_engine(settings: Settings, tiny: bool, console) -> object:
    """The synthesis engine, preparing the offline weights pack first when it is the source."""
    from voicebus.synthesis.engine import SynthesisEngine
    from voicebus.synthesis.weights import WeightsNotFound, prepare_offline_pack, resolve_weights

    if tiny:
        return SynthesisEngine.tiny()
    with console.status("resolving Kokoro weights") as status:
        try:
            resolve_weights(settings)
        except WeightsNotFound:
            prepare_offline_pack(settings, progress=lambda step: (console.log(step), status.update(step)))
        status.update("loading Kokoro-82M")
        started = time.monotonic()
        engine = SynthesisEngine.load(settings)
    console.log(f"Kokoro-82M loaded on {engine.device} in {time.monotonic() - started:.1f} s")
    return engine
