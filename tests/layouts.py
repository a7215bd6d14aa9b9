"""Tensor layouts of the tests' calls: the same values contiguous, transposed in memory, every other element of a
dimension twice as long, or broadcast (stride 0). Imports torch only, so that a process that loads a library other
than the installed redfuser_ops (tests/_user_specs_worker.py) can use it."""

from __future__ import annotations

import random

import torch

LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]


def make(shape, dtype, layout, dim, gen, values=None):
    """A tensor of `shape` and `dtype` laid out as `layout` along dim `dim` (values from `values` when given)."""
    shape = tuple(shape)
    nd = len(shape)
    if values is None:
        base = torch.randn(shape, generator=gen)
        if dtype == torch.float8_e4m3fn:
            base = base.clamp(-400, 400)
        base = base.to(dtype) if dtype.is_floating_point else (base * 4).to(dtype)
    else:
        base = values.to(dtype)
    if nd == 0 or layout == "contiguous":
        return base.contiguous()
    d = dim % nd
    if layout == "transposed" and nd >= 2:
        e = (d + 1) % nd
        return base.transpose(d, e).contiguous().transpose(d, e)
    if layout == "sliced":
        big = torch.zeros(shape[:d] + (2 * shape[d],) + shape[d + 1:], dtype=dtype)
        sl = [slice(None)] * nd
        sl[d] = slice(0, None, 2)
        big[tuple(sl)] = base
        return big[tuple(sl)]
    if layout == "expanded" and shape[d] > 0:
        return base.narrow(d, 0, 1).expand(shape)
    return base.contiguous()


def layout(x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """x as it is, transposed, or every other element of a twice-as-long dimension, along a random dimension (not
    expanded, which would repeat the values)."""
    return make(x.shape, x.dtype, rng.choice(["contiguous", "transposed", "sliced"]), rng.randrange(max(1, x.dim())),
                None, values=x)
