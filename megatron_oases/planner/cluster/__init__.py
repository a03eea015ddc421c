"""The cluster search (``oases plan --gpus N``): every DP x TP x PP layout planned (`search`), its
pipeline stage splits (`stage_split`) and the emulated check of the fastest (`verify`). It stands
above the planner core and runs the profiler and the compare harness through their public names."""
