"""voicebus: event-driven streaming text-to-speech on Apache Kafka.

One import name for the whole system. The base install is the client side: the agent SDK
(`voicebus.agents`), the contract and its schemas (`voicebus.schemas`), the settings and the bus
plumbing they need. The stages are subpackages whose extras bring their libraries:
`voicebus.gate` (``voicebus[gate]``), `voicebus.synthesis` (``voicebus[worker]``),
`voicebus.players` (the edge, ``voicebus[edge]``); `voicebus.ops` holds what runs around
them (the local broker, the demo, the benchmarks) and is never imported by a stage.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("voicebus")
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
