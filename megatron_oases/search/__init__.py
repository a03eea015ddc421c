"""``oases plan``: the command line over the planner core (`plan_cli`), and the cluster search
(``--gpus N``): every DP x TP x PP layout planned (`search`), its pipeline stage splits
(`stage_split`), the emulated check of the fastest (`verify`) and their part of the command line
(`cli`). It stands above the planner core (``megatron_oases/planner/``, which the runtime may
read) and runs the profiler and the compare harness through their public names, so that nothing
below it imports the search or the command."""
