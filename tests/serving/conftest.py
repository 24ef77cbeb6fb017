"""Tier ``serving``, every test here marked so: ``vllm serve``, proxies, routers, network namespaces."""

from harness.tiers import marking_hook

pytest_collection_modifyitems = marking_hook(__file__, "serving")
