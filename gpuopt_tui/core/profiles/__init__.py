"""Experiment profiles: TOML files validated into typed objects, one schema per run kind."""
