"""What the tests and the benchmarks share: processes and ports, network namespaces, vLLM engines and
servers, the 2P2D cluster, the threaded proxy, argument presets, tensor makers, fault injection, forged
pipes and test connectors. Not installed with kvbridge."""
