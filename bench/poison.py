"""Output poisoning for CUDA calls of torch.ops.redfuser.*: a helper and a pytest plugin.

The ops allocate their outputs through torch's caching allocator. Before a call, `poisoned_call` asks the op's
fake implementation (on the meta device) for the outputs' sizes, allocates blocks of exactly those sizes in the
same order on the current stream, fills them with 0xFF bytes (NaN in every float format, -1 in int32), and frees
them; the allocator is deterministic, so the op's own allocations of the same sizes in the same order get those
very blocks. Every output written by the kernel no longer holds 0xFF; an element the kernel skipped stays NaN
(or id -1), which the tests' comparisons catch. After the call the output pointers are checked against the
poisoned blocks and counted, so a run can tell whether poisoning took effect (an op that allocates a
workspace before its outputs would shift the blocks: that shows up as a miss).

Plugin: `python -m pytest -p bench.poison ...` runs every redfuser op called with CUDA tensors inside a test
through `poisoned_call` (a TorchDispatchMode active during the test call), and prints hit/miss counts at the
end. It stays out of torch.compile, CUDA graph capture and non-CUDA calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


@dataclass
class Stats:
    calls: int = 0
    hits: int = 0  # calls whose every output landed in poisoned memory
    misses: list[str] = field(default_factory=list)
    skipped: int = 0  # calls not poisoned (capture, no meta impl)


STATS = Stats()


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _is_cuda_call(args: Any, kwargs: Any) -> bool:
    leaves, _ = tree_flatten((args, kwargs))
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in leaves)


def poisoned_call(func: Any, args: tuple, kwargs: dict | None = None, stats: Stats = STATS) -> Any:
    """func(*args, **kwargs) with its CUDA outputs' memory filled with 0xFF beforehand."""
    kwargs = kwargs or {}
    device = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_cuda)
    if torch.cuda.is_current_stream_capturing():
        stats.skipped += 1
        return func(*args, **kwargs)
    try:
        metas = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
    except Exception:  # noqa: BLE001 - no meta implementation, or bad input: the real call says why
        stats.skipped += 1
        return func(*args, **kwargs)
    sizes = [m.untyped_storage().nbytes() if m.numel() else 0
             for m in tree_flatten(metas)[0] if isinstance(m, torch.Tensor)]
    blocks = [torch.full((max(n, 1),), 0xFF, dtype=torch.uint8, device=device) for n in sizes]
    ranges = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in blocks]
    del blocks  # all freed: the allocator is back in its state before, the same blocks now hold 0xFF
    result = func(*args, **kwargs)
    stats.calls += 1
    outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor) and t.is_cuda and t.numel()]
    hit = all(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for t in outs)
    if hit:
        stats.hits += 1
    else:
        stats.misses.append(f"{func}: outputs at {[hex(t.data_ptr()) for t in outs]}, poisoned "
                            f"{[(hex(lo), hi - lo) for lo, hi in ranges]}")
    return result


class PoisonMode(TorchDispatchMode):
    """Poisons the outputs of every torch.ops.redfuser.* call on CUDA tensors."""

    def __init__(self, stats: Stats = STATS) -> None:
        super().__init__()
        self.stats = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "redfuser" and _is_cuda_call(args, kwargs):
            return poisoned_call(func, args, kwargs, self.stats)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# pytest plugin (-p bench.poison)
# ----------------------------------------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - the helper works without pytest
    pytest = None

TOTAL = Stats()


def _wants_poison(item) -> bool:
    """Tests parametrized with a CUDA device, or marked gpu; not the torch.compile tests."""
    if not torch.cuda.is_available() or "compile" in item.name:
        return False
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(str(v) == "cuda" or (isinstance(v, torch.device) and v.type == "cuda")
                                    for v in callspec.params.values()):
        return True
    return item.get_closest_marker("gpu") is not None


if pytest is not None:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        if not _wants_poison(item):
            yield
            return
        stats = Stats()
        with PoisonMode(stats):
            yield
        item.user_properties.append(("redfuser_poison", json.dumps(
            {"calls": stats.calls, "hits": stats.hits, "skipped": stats.skipped, "misses": stats.misses[:3]})))

    def pytest_runtest_logreport(report):
        """Adds up the counts (also those that pytest-xdist workers send with their reports)."""
        if report.when != "call":
            return
        for key, value in getattr(report, "user_properties", ()):
            if key == "redfuser_poison":
                d = json.loads(value)
                TOTAL.calls += d["calls"]
                TOTAL.hits += d["hits"]
                TOTAL.skipped += d["skipped"]
                TOTAL.misses += [f"{report.nodeid}: {m}" for m in d["misses"]]

    def pytest_terminal_summary(terminalreporter):
        s = TOTAL
        terminalreporter.write_line(
            f"redfuser poison: {s.calls} CUDA op calls with poisoned outputs; outputs in poisoned memory in "
            f"{s.hits}, {len(s.misses)} misses; {s.skipped} calls not poisoned (graph capture / no meta impl)")
        for m in s.misses[:5]:
            terminalreporter.write_line(f"  miss: {m[:300]}")
