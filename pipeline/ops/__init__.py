"""Operations around the runtime, never imported by it: the local Kafka broker and schema
registry, the process daemon, the in-process stack, the demo and the benchmarks."""
