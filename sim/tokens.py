"""A stand-in tokenizer (4 characters a token) and seeded gibberish output text."""

from __future__ import annotations

import hashlib
import math
import random
import zlib

CHARS_PER_TOKEN = 4

# Output pieces that look like the random-weight model of the real vLLM fixture.
_SYLLABLES = ("pa", "ka", "va", "hopi", "bi", "po", "nu", "ezi", "wa", "pe", "cu", "he", "mo")
VOCAB: tuple[str, ...] = tuple(
    (" " if i % 3 == 0 else "") + a + b
    for i, (a, b) in enumerate((a, b) for a in _SYLLABLES for b in _SYLLABLES)
)


def count_tokens(text: str, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """Token count of a prompt: at least 1, about one token per 4 characters (or as many
    as told: an engine whose tokenizer counts unlike a router's chars / 4 estimate)."""
    return max(1, math.ceil(len(text) / chars_per_token))


def token_ids(text: str) -> tuple[int, ...]:
    """Deterministic token ids (no vocabulary): one per 4 characters, the CRC-32 of their
    UTF-8 bytes. The KV events carry them; `llmgw.tokenize` (`tokenizer: sim`) matches."""
    crc = zlib.crc32
    return tuple(crc(text[i : i + CHARS_PER_TOKEN].encode()) for i in range(0, len(text), 4))


def block_hashes(
    text: str, block_size: int, chars_per_token: float = CHARS_PER_TOKEN
) -> tuple[bytes, ...]:
    """Chained hashes of the prompt's *full* blocks; a partial last block is not cached."""
    chars_per_block = max(1, round(block_size * chars_per_token))
    full_blocks = len(text) // chars_per_block
    if full_blocks == 0:
        return ()
    hashes: list[bytes] = []
    parent = b""
    for index in range(full_blocks):
        chunk = text[index * chars_per_block : (index + 1) * chars_per_block].encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return tuple(hashes)


def id_block_hashes(ids: tuple[int, ...], block_size: int) -> tuple[bytes, ...]:
    """Chained hashes of the full blocks of a prompt given as token ids (a completion's):
    the ids themselves, not a text, so they never equal a text prompt's hashes."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(ids) - block_size + 1, block_size):
        chunk = ",".join(map(str, ids[start : start + block_size])).encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16, person=b"token-ids").digest()
        hashes.append(parent)
    return tuple(hashes)


def chat_prompt(messages: list[dict[str, object]]) -> str:
    """Flatten chat messages the way a chat template does: role markers then content."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            # OpenAI content parts: only text parts count toward the prompt.
            content = "".join(
                str(part.get("text", "")) for part in content if isinstance(part, dict)
            )
        parts.append(f"<|{message.get('role', 'user')}|>\n{content or ''}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


class OutputText:
    """Seeded source of output pieces; the same seed gives the same texts in order."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def pieces(self, count: int) -> list[str]:
        return self._rng.choices(VOCAB, k=count)

    def length(self, low: int, high: int) -> int:
        return self._rng.randint(low, high)

    def chance(self) -> float:
        return self._rng.random()
