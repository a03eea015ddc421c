"""Profiles for the Oases planner: measured (one Megatron layer per TMP degree on real process
groups) or analytic (FLOP counts and a cluster profile). See :mod:`megatron_oases.formats.profile`
for the file."""

from ..formats.profile import Profile, load_profile, save_profile

__all__ = ["Profile", "load_profile", "save_profile"]
