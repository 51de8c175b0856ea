"""Decoding vLLM's KV-event payloads (after msgpack): tagged maps, tagged arrays, errors."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from llmgw.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventError,
    decode_batch,
    decode_seq,
    encode_events,
)

STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [b"\x01" * 8, 2],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": None,  # newer fields are ignored
    "kv_cache_spec_sliding_window": None,
}
STORED = BlockStored((b"\x01" * 8, 2), None, (1, 2, 3, 4), 2, None, "GPU")
ARRAY_FIELDS = ([b"\x01" * 8, 2], None, [1, 2, 3, 4], 2, None)  # hashes..lora_id
HYBRID = {**STORED_MAP, "group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
HYBRID_STORED = BlockStored(
    (b"\x01" * 8, 2), None, (1, 2, 3, 4), 2, None, "GPU", 1, "sliding_window"
)


@pytest.mark.parametrize(
    ("raw", "event"),
    [
        (STORED_MAP, STORED),
        # the array form older vLLM releases sent (msgspec array_like, tag first)
        (["BlockStored", [b"\x01" * 8, 2], None, [1, 2, 3, 4], 2, None, "GPU"], STORED),
        ({"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}, BlockRemoved((7,), "GPU")),
        (["BlockRemoved", [7], None], BlockRemoved((7,), None)),
        (HYBRID, HYBRID_STORED),
        # vLLM's array positions: ..., lora_name, extra_keys, group_idx, kind, window
        (
            ["BlockStored", *ARRAY_FIELDS, "GPU", None, None, 1, "sliding_window", 1024],
            HYBRID_STORED,
        ),
        (
            {"type": "BlockRemoved", "block_hashes": [7], "group_idx": 1},
            BlockRemoved((7,), None, 1),
        ),
        (["BlockRemoved", [7], "GPU", 1], BlockRemoved((7,), "GPU", 1)),
        ({"type": "AllBlocksCleared"}, AllBlocksCleared()),
        (["AllBlocksCleared"], AllBlocksCleared()),
    ],
)
def test_decodes_both_encodings_through_msgpack(raw: Any, event: object) -> None:
    payload = msgpack.unpackb(msgpack.packb([1.5, [raw], 0]))
    batch = decode_batch(3, payload)
    assert (batch.seq, batch.ts, batch.dp_rank, batch.events) == (3, 1.5, 0, (event,))


def test_a_batch_sent_as_a_map_decodes_as_the_array_does() -> None:
    """A vLLM whose `EventBatch` is not `array_like` sends the batch as a map."""
    raw = msgpack.packb({"ts": 1.5, "events": encode_events((STORED,)), "data_parallel_rank": 0})
    batch = decode_batch(3, msgpack.unpackb(raw))
    assert (batch.seq, batch.ts, batch.dp_rank, batch.events) == (3, 1.5, 0, (STORED,))
    with pytest.raises(KvEventError, match="timestamp then a list"):
        decode_batch(3, {"ts": 1.5})


def test_unknown_event_types_are_skipped() -> None:
    batch = decode_batch(0, [0.0, [{"type": "SomethingNew"}, {"type": "AllBlocksCleared"}]])
    assert batch.events == (AllBlocksCleared(),)


def test_encode_then_decode_round_trips() -> None:
    events = (STORED, BlockRemoved((b"x",), "GPU"), AllBlocksCleared())
    assert decode_batch(0, [0.0, encode_events(events)]).events == events


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("nope", "payload must be the array"),
        ([0.0, "x"], "timestamp then a list"),
        ([0.0, [{"block_hashes": []}]], "no 'type' tag"),
        ([0.0, [{**STORED_MAP, "token_ids": "abc"}]], "token_ids must be a list of ints"),
        ([0.0, [{**STORED_MAP, "block_size": 0}]], "block_size must be a positive int"),
        ([0.0, [{**STORED_MAP, "block_hashes": [1.5]}]], "bytes or int"),
        ([0.0, [42]], "tagged map or array"),
    ],
)
def test_bad_payloads_raise_a_clear_error(payload: Any, message: str) -> None:
    with pytest.raises(KvEventError, match=message):
        decode_batch(0, payload)


def test_sequence_frame_is_8_bytes_big_endian() -> None:
    assert decode_seq((258).to_bytes(8, "big")) == 258
    with pytest.raises(KvEventError, match="8 bytes"):
        decode_seq(b"\x01")


def test_an_offloaded_tiers_events_are_skipped_and_keep_their_batchs_gpu_blocks() -> None:
    """vLLM's offloading connector adds its CPU tier's events to the same batches, without
    tokens or a block size: refused, they dropped the batch (its GPU blocks too), which
    then read as a gap on every offload."""
    offloaded = {
        "type": "BlockStored",
        "block_hashes": [b"o0"],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [b"o0"], "medium": "CPU"}
    batch = decode_batch(3, [0.0, [STORED_MAP, offloaded, removed], 0])
    assert batch.events == (STORED,)


@pytest.mark.parametrize(
    ("extra_keys", "lora_name", "keyed_from"),
    [
        (None, None, None),
        ([None, None], None, None),
        ([["sql-lora"], ["sql-lora"]], "sql-lora", None),  # an adapter's name on each block
        ([["tenant-7"], None], None, 0),  # a cache_salt on the first block
        ([None, [["mm-hash", 0]]], None, 1),  # an image in the second block
        ([["sql-lora", "tenant-7"], ["sql-lora"]], "sql-lora", 0),
    ],
)
def test_extra_keys_say_where_blocks_stop_being_keyed_by_tokens_alone(
    extra_keys: Any, lora_name: str | None, keyed_from: int | None
) -> None:
    raw = {**STORED_MAP, "extra_keys": extra_keys, "lora_name": lora_name}
    (event,) = decode_batch(0, [0.0, [raw]]).events
    assert isinstance(event, BlockStored) and event.keyed_from == keyed_from
    (again,) = decode_batch(0, [0.0, encode_events([event])]).events
    assert again == event


def test_malformed_extra_keys_are_a_clear_error() -> None:
    with pytest.raises(KvEventError, match="extra_keys must be a list"):
        decode_batch(0, [0.0, [{**STORED_MAP, "extra_keys": "salt"}]])
