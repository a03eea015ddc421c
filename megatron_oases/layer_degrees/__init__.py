"""Per-layer TMP degrees (paper §4.2; "hetero" in earlier versions): run any plan of TMP degrees
inside a TMP domain.

``--tensor-model-parallel-size T`` is the domain; layer l runs with degree d_l | T as T/d_l groups
of d_l consecutive ranks, each group on its share of the micro-batch. Process groups for every
degree are created once (:class:`.groups.LayerDegreeGroups`) and handed to the layers explicitly
(``pg_collection``); ``parallel_state`` is never changed.
"""
