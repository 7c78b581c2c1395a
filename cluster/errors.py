"""What a replica raises to the ingress about itself (not about one request's input)."""


class EngineFailedError(RuntimeError):
    """A replica's engine failed (a forward pass or a worker died): its requests belong
    elsewhere."""


class ReplicaDrainingError(RuntimeError):
    """The replica is shutting down and takes no new request: route it elsewhere."""
