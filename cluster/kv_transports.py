"""The `disaggregation.kv_transport` choices, in a module of their own that imports nothing:
the app config (deploy/disagg_config.py) validates the setting against them without loading the
transports themselves (cluster/disagg_replica.py), which pull in torch."""

# auto resolves to one of the other two (cluster/disagg_replica.py: kv_transport).
KV_TRANSPORTS = ("auto", "object_store", "collective")
