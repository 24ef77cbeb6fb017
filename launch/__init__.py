"""launch: the torchrun prefill/decode pair (``python -m launch.pair``) and the ``kvbridge`` command."""
