"""Whose prefix-cache blocks a request may reuse: the salt its block hashes are keyed by.

Block hashes chain from a seed (scheduler/block_manager.py); a salt mixed into the seed makes a
chain no other salt can produce, so a request finds only blocks computed under its own salt: on
the device, in the CPU and disk tiers (keyed by hash), in the router's prefix index and in a
disaggregated prefill's hand-off. The salt of a request is built here from:

- the tenant, under `prefix_cache_scope: tenant` (the default whenever keys are configured): one
  tenant's prompts never hit, or time, another's cached blocks, and `cached_tokens` never counts
  them;
- `cache_salt` (vLLM's field): requests naming the same salt share, others do not (under the
  tenant scope, only within the tenant);
- `prompt_cache_key`: a partition of the tenant's own cache; always scoped by the tenant, so two
  tenants choosing the same key share nothing.

None (shared scope, neither field given) leaves the hashes unsalted, as before scopes existed.
"""

from __future__ import annotations

import hashlib
import json

SCOPES = ("tenant", "shared")


def request_salt(
    scope: str, tenant: str, cache_salt: str | None = None, prompt_cache_key: str | None = None
) -> str | None:
    """The salt of one request's block hashes (a 32-character digest), or None for unsalted.

    The parts are encoded unambiguously (a JSON list of pairs) before they are hashed, so no choice
    of `cache_salt` can spell another tenant's salt."""
    if scope not in SCOPES:
        raise ValueError(f"prefix_cache_scope: must be one of {list(SCOPES)}, got {scope!r}")
    parts: list[tuple[str, str]] = []
    if scope == "tenant" or prompt_cache_key is not None:
        parts.append(("tenant", tenant))
    if cache_salt is not None:
        parts.append(("cache_salt", cache_salt))
    if prompt_cache_key is not None:
        parts.append(("prompt_cache_key", prompt_cache_key))
    if not parts:
        return None
    encoded = json.dumps(parts, ensure_ascii=True, separators=(",", ":")).encode()
    return hashlib.blake2b(encoded, digest_size=16, person=b"raylm-cache-salt").hexdigest()
