"""The prefix block hash: a full block is keyed by a hash chained over (parent hash, block
tokens), seeded by the request's LoRA adapter and cache salt. One function, shared by the ingress
(prompt blocks for routing), the router's prefix index and the scheduler's block pool."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import NoReturn

from scheduler.multimodal import ImageSpan, image_key

_ROOT = b"raylm-prefix-v1"


# num_tokens -> the packing of that many token ids (a few block sizes; cleared past 64 sizes).
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _packer(num_tokens: int) -> Callable[..., bytes]:
    """Packs num_tokens token ids as native int64s: array("q", ids).tobytes()'s bytes at under
    half its cost (array converts each item through a format string), so a decode step's new block
    costs one conversion that is cheap beside its blake2b call."""
    pack = _PACKERS.get(num_tokens)
    if pack is None:
        if len(_PACKERS) >= 64:
            _PACKERS.clear()
        pack = _PACKERS[num_tokens] = struct.Struct(f"{num_tokens}q").pack
    return pack


def _refuse(token_ids: Sequence[int]) -> NoReturn:
    """After struct refused token_ids: raise array's own error for them (OverflowError past
    int64, TypeError for a non-integer), as the hash raised before it packed with struct."""
    array("q", token_ids)
    raise ValueError(f"token_ids: not int64 token ids: {list(token_ids)[:8]!r}")


def _root(lora_name: str | None) -> bytes:
    """The chain's seed: a block computed under a LoRA adapter holds other KV than the same tokens
    under the base model or another adapter, so each adapter's chains start from its own seed (the
    base model's is unchanged)."""
    if lora_name is None:
        return _ROOT
    return _block_digest(_ROOT, b"lora:" + lora_name.encode())


def _salted(root: bytes, salt: str | None) -> bytes:
    """A chain's seed mixed with the request's cache salt (vLLM's `cache_salt`; the ingress's
    tenant scope): chains of different salts share no block, so no request can hit, or time,
    another salt's KV. None leaves the seed as it is."""
    return root if salt is None else _block_digest(root, b"salt:" + salt.encode())


def hash_block_tokens(
    parent_hash: int | None,
    block_token_ids: Sequence[int],
    lora_name: str | None = None,
    salt: str | None = None,
) -> int:
    """Stable 128-bit key of a full block: the same in every process (the router uses it too).
    lora_name and salt key the first block of a chain (parent_hash None) by the request's adapter
    and cache salt."""
    parent = (
        _salted(_root(lora_name), salt)
        if parent_hash is None
        else parent_hash.to_bytes(16, "little")
    )
    n = len(block_token_ids)
    try:
        block = (_PACKERS.get(n) or _packer(n))(*block_token_ids)
    except struct.error:
        _refuse(block_token_ids)
    # _block_digest inlined: a decode step's newly full block is hashed here (KVCacheManager).
    return int.from_bytes(blake2b(parent + block, digest_size=16).digest(), "little")


def _block_digest(parent: bytes, block: bytes) -> bytes:
    return blake2b(parent + block, digest_size=16).digest()


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    lora_name: str | None = None,
    salt: str | None = None,
) -> list[int]:
    """Extend the chain `hashes` (of token_ids' leading blocks) to at most num_blocks, in place;
    returns it.

    The same keys as hash_block_tokens block by block, of full blocks only (token_ids holding fewer
    leave the chain shorter). lora_name: the request's adapter (None: the base
    model) and salt: its cache salt (None: none), which seed the chain.
    """
    done = len(hashes)
    end = min(num_blocks, len(token_ids) // block_size)  # full blocks only
    if end <= done:
        return hashes
    parent = hashes[-1].to_bytes(16, "little") if done else _salted(_root(lora_name), salt)
    pack, append = _PACKERS.get(block_size) or _packer(block_size), hashes.append
    try:
        # One pack and one blake2b call per block, inlined: a decode step's new block is hashed
        # here, once per block_size steps per request (bench/scheduler_overhead.py).
        for start in range(done * block_size, end * block_size, block_size):
            block = pack(*token_ids[start : start + block_size])
            parent = blake2b(parent + block, digest_size=16).digest()  # _block_digest
            append(int.from_bytes(parent, "little"))  # a digest is its hash's bytes
    except struct.error:
        del hashes[done:]
        _refuse(token_ids[done * block_size : end * block_size])
    return hashes


def extend_image_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    spans: Sequence[ImageSpan],
    lora_name: str | None = None,
    salt: str | None = None,
) -> list[int]:
    """extend_block_hashes for a prompt with images: a block's bytes are followed by the digests
    of the images it covers (scheduler/multimodal.image_key), so the same placeholder ids over
    other pixels never hit; blocks of text alone hash as extend_block_hashes hashes them."""
    parent = _salted(_root(lora_name), salt) if not hashes else hashes[-1].to_bytes(16, "little")
    for i in range(len(hashes), min(num_blocks, len(token_ids) // block_size)):
        start = i * block_size
        block_ids = token_ids[start : start + block_size]
        try:
            block = _packer(block_size)(*block_ids)
        except struct.error:
            _refuse(block_ids)
        parent = _block_digest(parent, block + image_key(spans, start, start + block_size))
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    max_blocks: int | None = None,
    lora_name: str | None = None,
    salt: str | None = None,
) -> list[int]:
    """Chained hashes of the leading full blocks of token_ids, under the LoRA adapter lora_name
    (None: the base model) and the cache salt `salt` (None: unsalted)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    return extend_block_hashes([], token_ids, block_size, n, lora_name, salt)
