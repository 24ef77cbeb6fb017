"""Tier ``processes``, every test here marked so: two or more processes: pipes, buffers, the pair, the CLI."""

from harness.tiers import marking_hook

pytest_collection_modifyitems = marking_hook(__file__, "processes")
