"""Prometheus metrics of one edge: per-stage latency histograms (from the chunk timestamps and the
players' reports), the edge's own overhead, queue depths, clients and drops.

Each `EdgeMetrics` owns its own `CollectorRegistry` (no process-global state), which `/metrics`
renders.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from voicebus.schemas.messages import AudioChunk

# 1 ms .. 10 s, dense where a voice pipeline lives.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 5.0, 10.0)

# (stage, from-field, to-field) of an AudioChunk; `EDGE_RECEIVED` is when this edge consumed it.
EDGE_RECEIVED = "edge_received_at_us"
CHUNK_STAGES = (
    ("gate_hold", "text_complete_at_us", "released_at_us"),
    ("synthesis_queue", "released_at_us", "synthesis_started_at_us"),
    ("synthesis", "synthesis_started_at_us", "audio_ready_at_us"),
    ("publish", "audio_ready_at_us", "published_at_us"),
    ("bus_to_edge", "published_at_us", EDGE_RECEIVED),
    ("first_token_to_edge", "first_token_at_us", EDGE_RECEIVED),
)


class EdgeMetrics:
    def __init__(self, keep_overhead_samples: int = 0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.stage_latency = Histogram(
            "voicebus_stage_latency_seconds",
            "Latency of each pipeline stage, from the AudioChunk timestamps (first chunk of each sentence) "
            "and the players' audible-start reports",
            ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.edge_overhead = Histogram(
            "voicebus_edge_overhead_seconds", "Chunk consumed by the edge -> its frame handed to a client's socket",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.clients = Gauge("voicebus_edge_clients", "Connected, authenticated player clients", registry=r)
        self.sessions = Gauge("voicebus_edge_sessions", "Sessions the edge holds state for", registry=r)
        self.queue_depth = Gauge("voicebus_edge_queue_frames", "Frames queued for all clients", registry=r)
        self.queue_depth_max = Gauge("voicebus_edge_queue_frames_max", "Frames queued for the fullest client", registry=r)
        self.chunks = Counter("voicebus_edge_chunks_total", "Audio chunks consumed", registry=r)
        self.frames_sent = Counter("voicebus_edge_frames_sent_total", "Audio frames sent to clients", registry=r)
        self.drops = Counter("voicebus_edge_dropped_frames_total", "Audio frames dropped", ["reason"], registry=r)
        self.disconnects = Counter("voicebus_edge_disconnects_total", "Clients closed by the edge", ["reason"], registry=r)
        self.cancels = Counter("voicebus_edge_cancels_total", "Cancels applied", ["source"], registry=r)
        self.reports = Counter("voicebus_edge_playback_reports_total", "Playback reports received", ["kind"], registry=r)
        self.replay_bytes = Gauge("voicebus_edge_replay_bytes", "Bytes of frames held in replay buffers", registry=r)
        self.replay_evictions = Counter(
            "voicebus_edge_replay_evictions_total",
            "Sentences dropped from replay buffers to keep them under the edge's byte limit", registry=r)
        self.unserved_chunks = Counter(
            "voicebus_edge_unserved_chunks_total", "Audio chunks of sessions no player listens to on this edge",
            registry=r)
        self.refused = Counter("voicebus_edge_refused_total", "Client requests refused by a limit", ["reason"], registry=r)
        self.consumed_bytes = Counter("voicebus_edge_consumed_bytes_total",
                                      "Bytes of audio records this edge fetched live from the bus (the partitions it owns)",
                                      registry=r)
        self.backfill_bytes = Counter("voicebus_edge_backfill_bytes_total",
                                      "Bytes of audio records re-read for players resuming a session that moved here",
                                      registry=r)
        self.redirects = Counter("voicebus_edge_redirects_total",
                                 "Players sent to the edge that owns their session", registry=r)
        self.moved = Counter("voicebus_edge_moved_clients_total",
                             "Players told to reconnect because their session moved to another edge", registry=r)
        self.owned_partitions = Gauge("voicebus_edge_owned_partitions",
                                      "Audio partitions (and so sessions) this edge owns", registry=r)
        self.bad_records = Counter("voicebus_edge_bad_records_total", "Records the edge dead-lettered (any reason)", registry=r)
        # the telephony door (voicebus.players.telephony)
        self.telephony_calls = Counter("voicebus_edge_telephony_calls_total",
                                       "Telephony media streams opened: served, or the reason they were refused",
                                       ["provider", "outcome"], registry=r)
        self.telephony_frames = Counter("voicebus_edge_telephony_frames_total",
                                        "20 ms media frames of telephony calls: out (to the call), in (the caller's, unused)",
                                        ["provider", "direction"], registry=r)
        self.telephony_clears = Counter("voicebus_edge_telephony_clears_total",
                                        "Telephony calls told to drop their buffered audio (a cancel)", ["provider"],
                                        registry=r)
        self.overhead_samples: deque[float] | None = deque(maxlen=keep_overhead_samples) if keep_overhead_samples else None

    def observe_chunk(self, chunk: AudioChunk, edge_received_at_us: int) -> None:
        self.chunks.inc()
        if chunk.chunk_seq != 0:
            return  # per-sentence latencies: the first chunk carries them
        for stage, start, end in CHUNK_STAGES:
            a = getattr(chunk, start) or 0
            b = (edge_received_at_us if end == EDGE_RECEIVED else getattr(chunk, end)) or 0
            if a > 0 and b >= a:
                self.stage_latency.labels(stage).observe((b - a) / 1e6)

    def observe_sent(self, overhead_s: float) -> None:
        self.frames_sent.inc()
        self.edge_overhead.observe(overhead_s)
        if self.overhead_samples is not None:
            self.overhead_samples.append(overhead_s)

    def observe_sent_many(self, overhead_s: float, frames: int) -> None:
        """`frames` frames sent with the same overhead (one chunk written to its players' sockets
        at once): the count, the sum and one bucket move once, not once per frame."""
        self.frames_sent.inc(frames)
        hist = self.edge_overhead
        bounds, buckets, total = (getattr(hist, "_upper_bounds", None), getattr(hist, "_buckets", None),
                                  getattr(hist, "_sum", None))
        if bounds is None or buckets is None or total is None:  # a prometheus_client without them: one by one
            for _ in range(frames):
                hist.observe(overhead_s)
        else:
            total.inc(overhead_s * frames)
            buckets[next(i for i, bound in enumerate(bounds) if overhead_s <= bound)].inc(frames)
        if self.overhead_samples is not None:
            self.overhead_samples.extend([overhead_s] * frames)

    def render(self) -> bytes:
        return generate_latest(self.registry)
