"""Sum and max reductions for the Triton kernels, usable from Triton's interpreter too (the tests' CPU mode).

Why not tl.sum / tl.max: those are themselves @triton.jit functions of triton.language.standard, fixed when triton
is first imported. Imported before TRITON_INTERPRET=1 was set (pytest imports torch._inductor, which imports
triton), they are compiled-mode functions that an interpreted kernel cannot call. tl.reduce is a builtin, and the
same combine functions tl.sum and tl.max pass to it work in both modes: compiled, the code is exactly theirs; in the
interpreter, they are recognised and reduced with numpy. A Triton without those (private) names gets ours: correct
in both modes, only slow in the interpreter (it reduces element by element).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


SUM = getattr(tl.standard, "_sum_combine", _add)  # tl.reduce(x, axis, SUM) == tl.sum(x, axis) for floats
MAX = getattr(tl.standard, "_elementwise_max", _larger)  # tl.reduce(x, axis, MAX) == tl.max(x, axis)
