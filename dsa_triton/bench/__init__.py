"""Measuring, kept apart from the ops: ``python -m dsa_triton.bench`` checks and times every registered kernel.

- :mod:`.harness`: timing (``do_bench`` medians, CUDA-graph replays, rotated inputs), the measured ceilings and
  the floor of a :class:`~dsa_triton.registry.Cost`;
- :mod:`.run`: the bench itself; :mod:`.results`: results files (stamped with the environment and the git
  commit) and their tables; :mod:`.plot`: the picture beside each results file;
- :mod:`.reports`: reports beyond the per-kernel rows; :mod:`.aot`: sm_90 compiles without a GPU;
  :mod:`.hostprof`: the ops' host time with launches stubbed.

No op imports anything from here.
"""
