"""Case lists, numpy references and model builders shared by the CPU tests of the custom ops and
the trainer (``tests/ops``, ``tests/training``) and the GPU tests (``tests/gpu``): the CPU tests run
them on the library's CPU kernels, ``tests/gpu`` on its CUDA kernels, with the same tolerances."""
