"""The Oases overlapped TMP schedule (paper §3): the engine (``engine/``, no Megatron) and the
Megatron adapter (``megatron/``, Megatron's contract)."""
