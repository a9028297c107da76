"""The edge directory and the router's share-keeping, without Kafka: who owns a partition (the
latest claim), tombstones, other groups' records; a held session keeps what is routed for a
resume; sessions that move out are closed with 1012 and forgotten."""

import pytest

from voicebus.settings import Settings
from voicebus.topics import partition_of
from voicebus.players import protocol
from voicebus.players.router import SessionRouter
from voicebus.players.shard import DirectoryRecordError, EdgeDirectory, directory_key, directory_record, public_url
from voicebus.topics import edge_group_id
from voicebus.players.tone import tone_turn


def test_the_owner_of_a_partition_is_the_edge_of_the_latest_claim():
    d = EdgeDirectory("g")
    d.apply(*directory_record("g", "a", "ws://a/ws", {0, 1, 2, 3}), offset=0)
    assert d.owner(2).edge_id == "a"
    d.apply(*directory_record("g", "b", "ws://b/ws", {2, 3}), offset=1)  # b joined; a has not rewritten yet
    assert d.owner(2).edge_id == "b" and d.owner(0).edge_id == "a"
    d.apply(*directory_record("g", "a", "ws://a/ws", {0, 1}), offset=2)
    assert [d.owner(p).edge_id for p in range(4)] == ["a", "a", "b", "b"]
    assert d.urls() == ["ws://a/ws", "ws://b/ws"]
    d.apply(directory_key("g", "b"), None, offset=3)  # b stopped: its tombstone
    assert d.owner(2) is None and d.urls() == ["ws://a/ws"]
    # c took everything from a, which was killed (no tombstone): a is no longer listed to players
    d.apply(*directory_record("g", "c", "ws://c/ws", {0, 1, 2, 3}), offset=4)
    assert d.urls() == ["ws://c/ws"] and "a" in d.claims


def test_another_groups_records_are_ignored_and_a_bad_one_is_refused():
    d = EdgeDirectory("g")
    d.apply(*directory_record("other", "x", "ws://x/ws", {0}), offset=5)
    assert d.owner(0) is None and d.claims == {}
    with pytest.raises(DirectoryRecordError):
        d.apply(directory_key("g", "y"), b"not json", offset=6)
    with pytest.raises(DirectoryRecordError):
        d.apply(directory_key("g", "y"), b'{"url": "", "partitions": [0]}', offset=7)


def test_group_and_public_url_defaults():
    s = Settings(audio_topic="a.audio", edge_host="0.0.0.0", edge_port=9000)
    assert edge_group_id(s) == "voicebus-edge.a.audio" and edge_group_id(s.replace(edge_group_id="g")) == "g"
    assert public_url(s) == "ws://0.0.0.0:9000/ws" and public_url(s.replace(edge_public_url="/e1/ws")) == "/e1/ws"


def test_partition_of_is_kafkas_default_partitioner_on_the_session_key():
    from aiokafka.partitioner import DefaultPartitioner

    for sid in ("S", "session-42", "ünïcode"):
        assert partition_of(sid, 6) == DefaultPartitioner()(sid.encode(), list(range(6)), list(range(6)))


def test_a_held_session_keeps_what_is_routed_for_a_resume():
    router = SessionRouter()
    chunks = tone_turn("S", "t1", 3, 2)
    assert router.route(chunks[0]) == 0 and not router.served("S")  # unserved: dropped unframed
    assert router.hold("S") and not router.hold("S")
    for chunk in chunks[1:4]:  # a re-read that starts inside sentence 0
        router.route(chunk)
    channel = router.connect("S", resume={"turn_id": "t1", "sentence_seq": 0})
    audio = [protocol.decode_audio(f.payload) for f in channel.outbox if f.is_audio]
    # sentence 0's start is not here: it is not played from mid-word; sentence 1 is, whole
    assert [(a.sentence, a.chunk) for a in audio] == [(1, 0), (1, 1)]


def test_sessions_that_move_out_are_closed_with_1012_and_forgotten():
    router = SessionRouter()
    a, b = router.connect("A"), router.connect("B")
    router.route(tone_turn("A", "t1", 1, 1)[0])
    closed = router.move_out(lambda sid: sid == "A")
    assert closed == [a] and a.closed.code == protocol.CLOSE_SERVICE_RESTART and a.closed.reason == "moved"
    assert not router.served("A") and router.served("B") and b.closed is None
    assert router.n_clients == 1
    router.disconnect(a)  # the socket's own cleanup afterwards changes nothing
    assert router.n_clients == 1


# --- the authenticated directory ------------------------------------------------------------------

from voicebus.players.shard import ForgedDirectoryRecord, directory_headers  # noqa: E402

SECRET = "edges-share-this"


def test_a_signed_claim_is_believed_and_a_forged_one_refused():
    d = EdgeDirectory("g", SECRET)
    key, value = directory_record("g", "e1", "ws://edge-1:8765/ws", {0, 1})
    d.apply(key, value, 0, directory_headers(SECRET, key, value))
    assert d.owner(0).url == "ws://edge-1:8765/ws"
    forged_key, forged = directory_record("g", "evil", "wss://attacker.example/ws", {0, 1})
    with pytest.raises(ForgedDirectoryRecord, match="not signed"):
        d.apply(forged_key, forged, 1)
    with pytest.raises(ForgedDirectoryRecord):
        d.apply(forged_key, forged, 2, directory_headers("another-secret", forged_key, forged))
    with pytest.raises(ForgedDirectoryRecord):  # a signature moved onto another value
        d.apply(forged_key, forged, 3, directory_headers(SECRET, key, value))
    assert d.owner(0).url == "ws://edge-1:8765/ws" and d.urls() == ["ws://edge-1:8765/ws"]


def test_an_unsigned_tombstone_cannot_remove_an_edge():
    d = EdgeDirectory("g", SECRET)
    key, value = directory_record("g", "e1", "ws://edge-1:8765/ws", {0})
    d.apply(key, value, 0, directory_headers(SECRET, key, value))
    with pytest.raises(ForgedDirectoryRecord, match="tombstone"):
        d.apply(key, None, 1)
    assert d.owner(0) is not None
    d.apply(key, None, 2, directory_headers(SECRET, key, None))
    assert d.owner(0) is None


def test_an_allowed_origin_needs_no_signature():
    d = EdgeDirectory("g", SECRET, allowed_origins=["https://edge-3.example.com"])
    key, value = directory_record("g", "e3", "wss://edge-3.example.com/ws", {2})
    d.apply(key, value, 0)
    assert d.owner(2).url == "wss://edge-3.example.com/ws"
    other_key, other = directory_record("g", "e4", "wss://edge-4.example.com/ws", {3})
    with pytest.raises(ForgedDirectoryRecord):
        d.apply(other_key, other, 1)
