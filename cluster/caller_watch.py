"""Which callers of a replica are gone, so a dead ingress's generations are aborted at once.

Ray keeps running an actor's streaming generator after its caller dies: without this, each
generation of a dead ingress replica would run to max_tokens, holding its KV blocks and batch slot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.exceptions import ActorDiedError

logger = logging.getLogger(__name__)


class CallerGoneError(RuntimeError):
    """The actor that asked for a generation is dead: nobody reads the rest of it."""


class CallerWatch:
    """Probes caller actors by name; a caller is gone only when Ray says it died or its name is
    free.

    A slow or briefly unreachable caller is never taken for dead: the probe's timeout means
    "unknown".
    """

    def __init__(self, namespace: str, probe_timeout_s: float = 5.0) -> None:
        self.namespace = namespace
        self.probe_timeout_s = probe_timeout_s
        self._handles: dict[str, Any] = {}

    async def gone(self, callers: set[str]) -> set[str]:
        """The callers among these that are dead; forgets handles of callers no longer asked
        about."""
        for name in set(self._handles) - callers:
            del self._handles[name]
        results = await asyncio.gather(*(self._is_gone(name) for name in callers))
        return {name for name, dead in zip(callers, results) if dead}

    async def _is_gone(self, name: str) -> bool:
        handle: Any = self._handles.get(name)
        if handle is None:
            try:
                handle = await asyncio.to_thread(ray.get_actor, name, namespace=self.namespace)
            except ValueError:  # no live actor holds the name any more
                return True
            self._handles[name] = handle
        try:
            await asyncio.wait_for(handle.__ray_ready__.remote(), timeout=self.probe_timeout_s)
        except ActorDiedError:
            self._handles.pop(name, None)
            return True
        except Exception as exc:
            logger.debug("caller %s did not answer its probe: %r", name, exc)
        return False
