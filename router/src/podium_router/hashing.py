"""A prompt's block hashes, as the replicas' prefix caches compute them.

Podium's block manager registers each FULL block of ``block_size`` tokens under a chained hash:
a 128-bit BLAKE2b digest of ``b"\\x00"`` (first block) or ``b"\\x01"`` + the parent's hash as 16
little-endian bytes, then the block's token ids as little-endian signed 64-bit integers, then, for
a request with a LoRA adapter, that adapter's ``block_hash_extra`` text as UTF-8 (the replica's report
gives it per adapter: it holds the replica's own key for the adapter's registration, so one adapter
hashes differently on each replica; nothing for the base model). A replica names this scheme in its
report (``BLOCK_HASH_SCHEME``); the router trusts a replica's KV events only under a scheme it
implements here. ``tests/test_kv_events.py`` compares this code with the block manager's hashes,
adapters' included (the router cannot import the core): change one and that test fails until the
other and the scheme's name follow.

For replicas that are not Podium (no KV events, maybe no tokenizer endpoint) the router tracks
what it routed there approximately: the same chained hashes over the request's text, cut into
blocks of ``TEXT_BLOCK_CHARS`` characters (token ids, where the router has them, in the replica's
block size), each block followed by ``model=NAME`` for a request naming a model: such a replica does
not say which of its models are LoRA adapters, so no two models' prefixes count as one's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_HASH_SCHEME = "podium-blake2b128-chain/1"
TEXT_BLOCK_CHARS = 64


def _chain(parent: int | None, data: bytes) -> int:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(16, "little"))
    digest.update(data)
    return int.from_bytes(digest.digest(), "little")


def chained_block_hash(parent: int | None, token_ids: Sequence[int], extra: str | None = None) -> int:
    data = array("q", token_ids).tobytes()
    return _chain(parent, data if extra is None else data + extra.encode())


def block_hashes(token_ids: Sequence[int], block_size: int, extra: str | None = None) -> list[str]:
    """The hex hashes (as replicas report them) of the blocks a replica could serve from its cache:
    the full blocks, less the last token's (a replica always computes the prompt's last token).
    ``extra``: the request's LoRA adapter's ``block_hash_extra`` on that replica (None: the base model)."""
    hashes, parent = [], None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = chained_block_hash(parent, token_ids[start:start + block_size], extra)
        hashes.append(f"{parent:032x}")
    return hashes


def text_block_hashes(text: str, block_chars: int = TEXT_BLOCK_CHARS, extra: str | None = None) -> list[str]:
    """Approximate prefix keys of a text (for replicas whose cache the router cannot see); ``extra``
    as in ``block_hashes`` (another model's or adapter's prefixes never match)."""
    hashes, parent = [], None
    data = text.encode("utf-8", "surrogatepass")
    tail = b"" if extra is None else extra.encode()
    for start in range(0, len(data) // block_chars * block_chars, block_chars):
        parent = _chain(parent, data[start:start + block_chars] + tail)
        hashes.append(f"t{parent:032x}")
    return hashes
