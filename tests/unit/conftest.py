"""Tier ``unit``, every test here marked so: one process: no subprocess, no vLLM engine."""

from harness.tiers import marking_hook

pytest_collection_modifyitems = marking_hook(__file__, "unit")
