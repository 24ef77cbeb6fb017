"""Tier ``engines``, every test here marked so: in-process vLLM engines and LLM objects."""

from harness.tiers import marking_hook

pytest_collection_modifyitems = marking_hook(__file__, "engines")
