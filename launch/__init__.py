"""launch: the torchrun prefill/decode pair (``python -m launch.pair``) and the ``kvbridge`` command."""

#: kvbridge's version; pyproject.toml reads it from here.
__version__ = "0.1.0"
