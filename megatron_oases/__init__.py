"""megatron-oases: overlapped tensor-model-parallel training (Oases) as a plug-in for Megatron-Core.

Importing this package changes nothing in Megatron-Core; patches are installed explicitly after the
arguments are parsed (see :mod:`megatron_oases.patches`).
"""

__version__ = "0.1.0"
