"""What a synthesis worker measures: its Prometheus metrics and what each cancel did.

`WorkerMetrics` owns one registry per worker (no global state: tests run several workers in one
process); the shared shell (`voicebus.shell`) registers its own counters (records dead-lettered,
tasks restarted) in the same registry, so ``/metrics`` shows them all. `CancelObservation` is one
cancel's record, kept in `SynthesisWorker.cancel_log` for logs, tests and the benchmark.
`RealTimeWatch` says when the worker makes speech slower than it plays.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CANCEL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FIRST_CHUNK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REALTIME_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)


class WorkerMetrics:
    """The worker's Prometheus metrics, in a registry of their own."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.registry = CollectorRegistry()
        labels = {"registry": self.registry}
        self.queue_depth = Gauge("voicebus_worker_queue_depth", "Requests accepted, waiting for synthesis", **labels)
        self.in_flight = Gauge("voicebus_worker_in_flight", "Requests queued or being synthesized", **labels)
        self.max_in_flight = Gauge("voicebus_worker_max_in_flight", "Bound on requests in flight", **labels)
        self.paused = Gauge("voicebus_worker_fetch_paused", "1 while fetching is paused (full)", **labels)
        self.consumer_lag = Gauge(
            "voicebus_worker_consumer_lag", "Requests on the broker not yet fetched (highwater - position)",
            ["partition"], **labels)
        self.uncommitted = Gauge(
            "voicebus_worker_uncommitted", "Requests fetched whose offsets are not committed yet", **labels)
        self.requests = Counter("voicebus_worker_requests", "Requests settled, by outcome", ["outcome"], **labels)
        self.failures = Counter(
            "voicebus_worker_sentences_failed", "Requests the engine could not speak, by reason", ["reason"], **labels)
        self.chunks = Counter("voicebus_worker_chunks_published", "Audio chunks published", **labels)
        self.speak_retries = Counter(
            "voicebus_worker_speak_retries", "Syntheses tried again after a transient fault (out of memory, a "
            "device error) before any of their audio was made, by error", ["error"], **labels)
        self.publish_retries = Counter(
            "voicebus_worker_publish_retries", "Sends that failed and were retried (broker down, timeout), by error",
            ["error"], **labels)
        self.commit_retries = Counter(
            "voicebus_worker_commit_retries", "Offset commits that failed and were retried", **labels)
        self.cancels_seen = Counter("voicebus_worker_cancels_seen", "Cancel events applied", **labels)
        self.cancel_to_last_chunk = Histogram(
            "voicebus_worker_cancel_to_last_chunk_seconds",
            "From a cancel seen to the broker's ack of the turn's last chunk (0 when no send was on its way)",
            buckets=CANCEL_BUCKETS, **labels)
        self.cancel_to_stopped = Histogram(
            "voicebus_worker_cancel_to_synthesis_stopped_seconds",
            "From a cancel seen to the running synthesis of the turn returning", buckets=CANCEL_BUCKETS, **labels)
        self.first_chunk = Histogram(
            "voicebus_worker_request_to_first_chunk_seconds",
            "From a request received to its first chunk published", buckets=FIRST_CHUNK_BUCKETS, **labels)
        self.realtime_factor = Histogram(
            "voicebus_worker_realtime_factor",
            "Per spoken sentence: seconds from synthesis start to its last audio over the seconds of audio "
            "(above 1: made slower than it plays, the listener hears gaps)", buckets=REALTIME_BUCKETS, **labels)
        self.max_in_flight.set(0)


@dataclass
class CancelObservation:
    """What one cancel did on this worker (kept for logs, tests and the benchmark)."""

    session_id: str
    turn_id: str | None
    seen_at_us: int
    purged: int
    stopped: int
    last_chunk_published_at_us: int = 0  # ack of a send already on its way when the cancel was seen
    synthesis_stopped_at_us: int = 0

    @property
    def cancel_to_last_chunk_ms(self) -> float:
        return max(0, self.last_chunk_published_at_us - self.seen_at_us) / 1000.0


class RealTimeWatch:
    """Whether a worker makes speech as fast as it plays: the median real-time factor of its last
    ``window`` spoken sentences (`voicebus.synthesis.chunks.ChunkAssembler.realtime_factor`), once it has ``min_sentences``.
    Above ``threshold`` (1) no scheduling helps: every listener of this worker hears gaps inside
    sentences (a CPU without AMX or AVX-512 BF16 at one thread, docs/benchmarks.md). `observe` returns
    that median when it crosses the threshold upward, once until it has been back under it; the
    worker logs it as a warning."""

    def __init__(self, window: int = 20, min_sentences: int = 3, threshold: float = 1.0) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self.min_sentences, self.threshold = min_sentences, threshold
        self.slow = False

    def observe(self, realtime_factor: float) -> float | None:
        self._recent.append(realtime_factor)
        if len(self._recent) < self.min_sentences:
            return None
        median = statistics.median(self._recent)
        was_slow, self.slow = self.slow, median > self.threshold
        return median if self.slow and not was_slow else None
