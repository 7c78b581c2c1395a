"""The fleet router's pure logic: policies, load accounting, the prefix index and circuit breakers.

No Ray and no torch: cluster/serve_router.py adapts router.fleet.FleetState to Serve, and sim/ runs
the same objects on a simulated clock.
"""
