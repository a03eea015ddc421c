"""The schedule's Megatron adapter, Megatron's contract: the schedule bound to one model instance
(``binding``: the decoder's and the GPT model's forwards, the TP linears re-classed into deferring
ones), Megatron's layers as blocks, the sequence split, the stage ends and the loss, the RNG
states, CUDA graphs, the entry into the engine (``entry``) and the ``oases-schedule`` patch. Each
piece checks at install time that the Megatron code it relies on is what Megatron runs
(``compat.require_call`` / ``require_symbol``)."""
