"""The files the planner writes and the runtime reads: the contract between them.

* :mod:`.plan` — the per-layer TMP plan (``oases plan --out plan.json``, ``--oases-plan``).
* :mod:`.profile` — the layer profile (``oases profile --out profile.json``, read by ``oases plan``).
"""
