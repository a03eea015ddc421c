"""The schedule's engine (paper §3, Alg. 1-2): sub-batch programs of compute and collective ops,
their interleaved executor, the forward and backward program builders, the autograd node, the
early reductions, the deferral switch and the FSDP2 gathers. It imports nothing of Megatron: the
blocks, the split and the RNG states come in as arguments, so it can be changed with its unit
tests alone (``tests/unit/test_engine.py``, ``test_executor.py``; they run without
megatron-core). Megatron's side is ``schedule/megatron/``."""
