"""Benchmarks: the pipe against raw gloo, the lookup buffer, and kvbridge beside its peers."""
