"""The runner's features: one module per capability that can be switched on, each a RunnerFeature
(base.py) listed once by build.py."""
