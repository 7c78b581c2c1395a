"""Attention backends over the paged KV cache (see workers.layers.attention)."""
