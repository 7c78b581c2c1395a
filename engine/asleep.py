"""EngineAsleepError in a module of its own: the HTTP layer maps it to 503 and must not import the
weight-update machinery (torch) to do so."""

from __future__ import annotations


class EngineAsleepError(ValueError):
    """The engine is asleep (or its weights were discarded): no request can run until wake_up
    (and update_weights). A ValueError, as any request the engine refuses at add_request (the
    served engine loop fails that request alone); the HTTP layer answers it 503 + Retry-After."""

    retry_after_s = 10.0
