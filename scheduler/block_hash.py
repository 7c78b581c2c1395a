"""The prefix block hash: a full block is keyed by a hash chained over (parent hash, block
tokens), seeded by the request's LoRA adapter and cache salt. One function, shared by the ingress
(prompt blocks for routing), the router's prefix index and the scheduler's block pool."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from scheduler.multimodal import ImageSpan, image_key

_ROOT = b"raylm-prefix-v1"


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
    return int.from_bytes(_block_digest(parent, array("q", block_token_ids).tobytes()), "little")


def _block_digest(parent: bytes, block: bytes) -> bytes:
    return hashlib.blake2b(parent + block, digest_size=16).digest()


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
    leave the chain shorter), with the tokens turned into bytes once for the whole run: a prompt's
    blocks cost one conversion, not one each. lora_name: the request's adapter (None: the base
    model) and salt: its cache salt (None: none), which seed the chain.
    """
    done = len(hashes)
    if num_blocks <= done:
        return hashes
    parent = _salted(_root(lora_name), salt) if not hashes else hashes[-1].to_bytes(16, "little")
    data = array("q", token_ids[done * block_size : num_blocks * block_size]).tobytes()
    step = 8 * block_size
    for offset in range(0, len(data) - step + 1, step):  # full blocks only
        parent = _block_digest(parent, data[offset : offset + step])  # a digest is its hash's bytes
        hashes.append(int.from_bytes(parent, "little"))
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
        block = array("q", token_ids[start : start + block_size]).tobytes()
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
