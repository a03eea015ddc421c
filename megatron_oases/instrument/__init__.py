"""Instruments on Megatron's loop: golden values (``--log-json``)."""
