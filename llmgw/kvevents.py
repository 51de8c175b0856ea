"""vLLM KV-cache events as plain values, decoded from msgpack-decoded Python objects (pure).

The wire (`vllm/distributed/kv_events.py`): ZMQ multipart `(topic, 8-byte big-endian
sequence number, msgpack payload)`; the payload is the array `[ts, [event, ...], dp_rank?]`.
vLLM encodes events as maps tagged by `type` (`{"type": "BlockStored", ...}`); older
releases sent arrays tagged by their first element (`["BlockStored", hashes, ...]`):
both decode here. Engine block hashes are bytes or ints (`ExternalBlockHash`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EngineHash = bytes | int


class KvEventError(ValueError):
    """A payload that is not a vLLM KV event batch (the message says what was wrong)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    # A hybrid model's KV cache group (None before vLLM sent it) and its kind
    # ("full_attention", "sliding_window", ...; None before vLLM sent it).
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    lora_id: int | None = None  # an adapter's blocks, from releases that sent no lora_name
    # The first block whose hash takes more than the tokens and the adapter (vLLM's
    # `extra_keys`: a cache_salt, an image, prompt embeddings); it and the blocks after it
    # serve only requests carrying the same, so they are not indexed. None: every block.
    keyed_from: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None


# Field order of the array-encoded (older msgspec array_like) events, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_STORED_TAIL = ("medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")


def _hash(value: Any) -> EngineHash:
    if isinstance(value, bytes | int) and not isinstance(value, bool):
        return value
    raise KvEventError(f"block hash must be bytes or int, got {type(value).__name__}")


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list | tuple):
        raise KvEventError(f"block_hashes must be a list, got {type(value).__name__}")
    return tuple(_hash(h) for h in value)


def _opt_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventError(f"{name} must be a string or null, got {type(value).__name__}")


def _opt_int(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KvEventError(f"{name} must be an int or null, got {type(value).__name__}")


def _as_map(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        if "type" not in raw:
            raise KvEventError("event map has no 'type' tag")
        return raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag, values = raw[0], list(raw[1:])
        names: tuple[str, ...]
        if tag == "BlockStored":
            names = (*_STORED_FIELDS, *_STORED_TAIL)
        elif tag == "BlockRemoved":
            names = ("block_hashes", "medium", "group_idx")
        else:
            names = ()
        return {"type": tag, **dict(zip(names, values, strict=False))}
    raise KvEventError(f"an event must be a tagged map or array, got {type(raw).__name__}")


# Engines put the GPU tier in `medium` (None on older releases); offloaded tiers (CPU,
# storage) are not what a prefill reuses without a transfer, so they are not followed.
GPU_MEDIA = (None, "GPU")


def _keyed_from(extra_keys: Any, lora_name: str | None) -> int | None:
    """The first block whose extra keys hold more than the adapter's name (which each
    of an adapter's blocks carries first); None when there is none."""
    if extra_keys is None:
        return None
    if not isinstance(extra_keys, list | tuple):
        raise KvEventError(f"extra_keys must be a list or null, got {type(extra_keys).__name__}")
    for i, keys in enumerate(extra_keys):
        if keys is None:
            continue
        if not isinstance(keys, list | tuple):
            raise KvEventError(f"extra_keys[{i}] must be a list or null")
        if list(keys) not in ([], [lora_name]):
            return i
    return None


def decode_event(raw: Any) -> KvEvent | None:
    """One event; None for a type this router does not use (newer engines add some) and
    for an offloaded tier's blocks, checked no further: vLLM's offloading connector adds
    `BlockStored` events without tokens or a block size to the same batches, and one
    refused would drop its batch's GPU blocks with it."""
    fields = _as_map(raw)
    tag = fields["type"]
    if tag in ("BlockStored", "BlockRemoved") and fields.get("medium") not in GPU_MEDIA:
        return None
    if tag == "BlockStored":
        tokens = fields.get("token_ids")
        if not isinstance(tokens, list | tuple) or not all(isinstance(t, int) for t in tokens):
            raise KvEventError("BlockStored.token_ids must be a list of ints")
        size = fields.get("block_size")
        if not isinstance(size, int) or size < 1:
            raise KvEventError(f"BlockStored.block_size must be a positive int, got {size!r}")
        parent = fields.get("parent_block_hash")
        lora_name = _opt_str(fields.get("lora_name"), "lora_name")
        return BlockStored(
            block_hashes=_hashes(fields.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(tokens),
            block_size=size,
            lora_name=lora_name,
            medium=_opt_str(fields.get("medium"), "medium"),
            group_idx=_opt_int(fields.get("group_idx"), "group_idx"),
            kv_cache_spec_kind=_opt_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
            lora_id=_opt_int(fields.get("lora_id"), "lora_id"),
            keyed_from=_keyed_from(fields.get("extra_keys"), lora_name),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            _hashes(fields.get("block_hashes")),
            _opt_str(fields.get("medium"), "medium"),
            _opt_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(seq: int, payload: Any) -> EventBatch:
    """`[ts, [event, ...], dp_rank?]` (msgpack-decoded) with its sequence number; or the
    same as a map (`ts`, `events`, `data_parallel_rank`), as a vLLM whose `EventBatch` is
    not `array_like` sends it."""
    if isinstance(payload, dict):
        payload = [payload.get("ts"), payload.get("events"), payload.get("data_parallel_rank")]
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise KvEventError("payload must be the array [ts, [events...], dp_rank?]")
    ts, raw_events = payload[0], payload[1]
    if not isinstance(ts, int | float) or not isinstance(raw_events, list | tuple):
        raise KvEventError("payload must start with a timestamp then a list of events")
    rank = payload[2] if len(payload) > 2 and isinstance(payload[2], int) else None
    events = [decode_event(e) for e in raw_events]
    return EventBatch(seq, float(ts), tuple(e for e in events if e is not None), rank)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _encode_extra_keys(e: BlockStored) -> list[list[Any] | None] | None:
    """vLLM's `extra_keys` for these blocks: the adapter's name on each, and a cache salt
    from `keyed_from` on (what tells those blocks apart)."""
    if e.keyed_from is None:
        return None
    plain: list[Any] | None = [e.lora_name] if e.lora_name is not None else None
    salted = [*(plain or []), "salt"]
    return [plain if i < e.keyed_from else salted for i in range(len(e.block_hashes))]


def encode_events(events: Sequence[KvEvent]) -> list[dict[str, Any]]:
    """Events as vLLM's tagged maps (tests and tools build payloads with it)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": list(e.block_hashes),
                    "parent_block_hash": e.parent_block_hash,
                    "token_ids": list(e.token_ids),
                    "block_size": e.block_size,
                    "lora_id": e.lora_id,
                    "medium": e.medium,
                    "lora_name": e.lora_name,
                    "group_idx": e.group_idx,
                    "kv_cache_spec_kind": e.kv_cache_spec_kind,
                    "extra_keys": _encode_extra_keys(e),
                }
            )
        elif isinstance(e, BlockRemoved):
            out.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": list(e.block_hashes),
                    "medium": e.medium,
                    "group_idx": e.group_idx,
                }
            )
        else:
            out.append({"type": "AllBlocksCleared"})
    return out
