"""The machine the kernels run on: Numba's flags and the CPU features (``jit``), the thread
policy (``threads``), the measured limits (``probe``) and the settings of llamatrace's own
processes (``runtime``). Imports nothing: ``runtime`` must load without Numba."""
