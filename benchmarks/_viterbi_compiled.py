"""The compiled Triton Viterbi kernel of the last launch, for the benchmarks' resource reports (registers, spills,
shared memory, PTX, occupancy). The package keeps no such global: ``record()`` wraps its kernel object so that each
launch's compiled kernel is kept here; results are unchanged (the launch itself is the package's)."""

from __future__ import annotations

from exl3tool.kernels import viterbi as vmod


class _Recorder:
    """Stands in for ``vmod._viterbi_kernel``: ``kernel[grid](...)`` launches and keeps what the launch returns."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.last = None

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.last = launch(*args, **kwargs)
            return self.last

        return run

    def __getattr__(self, name: str):  # warmup and the rest: the kernel's own
        return getattr(self.kernel, name)


def record() -> None:
    """Keep the compiled kernel of every later launch (GPU only: under the interpreter nothing is compiled)."""
    if vmod._HAVE_TRITON and not vmod.interpreter_active() and not isinstance(vmod._viterbi_kernel, _Recorder):
        vmod._viterbi_kernel = _Recorder(vmod._viterbi_kernel)


def last_compiled():
    """The compiled kernel of the last launch since ``record()``; None before one."""
    kernel = vmod._viterbi_kernel
    return kernel.last if isinstance(kernel, _Recorder) else None
