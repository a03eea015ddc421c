"""The GPU check's steps (``benchmarks/gpu/check.py`` is their driver), one module each.

Each step module has ``LIMIT_S`` (its time limit on a GPU; the dry run gets twice), ``OPTIONS``
(the driver's settings it takes as keyword arguments: ``save``, ``gemm_rate``, ``mem_gbs``,
``trace_dir``, ``deadline_s``, ``rows``, ``iters``, ``only``), ``run(dry, **options)`` (its result,
a JSON dict; it runs in a process of its own) and ``report(result, env)`` (its report.md lines;
``env`` is the env step's result). :mod:`.common` holds what several steps share.
"""
