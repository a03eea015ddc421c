"""Megatron-Core training driver used by ``oases train`` (a pretrain_gpt.py equivalent)."""
