"""The wire contract: Avro schemas (`*.avsc`) for every message on the bus.

Each `.avsc` here is the current writer schema of one message type. Older writer schemas that
may still be on the bus live in `history/`, so a reader can decode them by fingerprint. Changes
are additive, with defaults only (see docs/kafka.md).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

SCHEMA_DIR = Path(str(resources.files(__name__)))

CURRENT = {
    "TextEvent": "text_event.avsc",
    "ControlEvent": "control_event.avsc",
    "SynthesisRequest": "synthesis_request.avsc",
    "AudioChunk": "audio_chunk.avsc",
    "PlaybackReport": "playback_report.avsc",
    "TurnHeard": "turn_heard.avsc",
    "FloorEvent": "floor_event.avsc",
}


def load(name: str) -> dict:
    """The current schema of message type `name` as a JSON object."""
    return json.loads((SCHEMA_DIR / CURRENT[name]).read_text())


def load_history() -> list[dict]:
    """Every older writer schema kept for decoding, oldest first by file name."""
    return [json.loads(p.read_text()) for p in sorted((SCHEMA_DIR / "history").glob("*.avsc"))]
