"""``oases compare``: stock Megatron vs the Oases schedule variants, paper Table 3 style."""
