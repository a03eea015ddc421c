"""Emulated-interconnect testbed: cluster profiles and link emulation for CPU runs."""
