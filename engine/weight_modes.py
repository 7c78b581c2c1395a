"""The choices a weight update and sleep take, in a module of their own: the ingress checks an
admin command against them (cluster/weights_admin.py) and must not import the weight-update
machinery (torch) to do so. engine/weights.py applies them."""

from __future__ import annotations

# What a weight update does with the requests in flight: let them finish on the old weights, or
# preempt them and recompute on the new ones.
IN_FLIGHT = ("finish", "recompute")
# 1 frees the KV cache; 2 also moves the weights to host memory (or drops them).
SLEEP_LEVELS = (1, 2)
