"""CuTe DSL kernels of fa4 and the ahead-of-time build driver.

Build-time only: importing anything below ``fa4_kernels.sm90`` needs ``nvidia-cutlass-dsl``.
``catalog`` and ``heuristics`` are plain Python and are also used by the CPU tests.
"""
