"""``--oases-schedule auto``: the run's first iterations time the schedules that can run, and the
rest of the run keeps the fastest (``docs/schedules.md``, "Choosing on the user's machine").

:mod:`.candidates`: which schedules are candidates under a command line (each one checked by the
rules of :mod:`megatron_oases.validation`), the trial's budget and its one-line refusals, and the
trial itself (:class:`.candidates.Trial`: order, early drops, the choice, the table) — pure, no
torch. :mod:`.runtime`: the ``oases-autotune`` patch on Megatron's ``train_step`` that runs the
trial, its policy (timing, a failed candidate dropped, the choice in ``--log-json`` and the
checkpoint); :mod:`.agreement`: the world's agreement after each trial step; :mod:`.step_retry`:
``train_step``'s arguments by name, and a failed step run again as if it had not run.
"""
