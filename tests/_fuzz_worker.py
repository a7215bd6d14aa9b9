"""The process that makes the fuzz test's op calls (tests/test_fuzz.py), so that a crash of an op (SIGSEGV, SIGFPE,
abort) kills this process and not the test run.

Protocol over a multiprocessing connection: the parent sends (op name, args, kwargs) with tensors pickled (their
sizes, strides and storage offsets are kept); the worker answers ("ok", outputs) or ("error", type name, message).
None ends the loop.
"""

from __future__ import annotations


def serve(conn) -> None:
    import torch

    import redfuser_ops  # noqa: F401  (loads the ops)

    torch.set_num_threads(1)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name, args, kwargs = msg
        try:
            out = getattr(torch.ops.redfuser, name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (reported to the parent, which judges the type and the message)
            conn.send(("error", type(e).__name__, str(e)))
            continue
        conn.send(("ok", out))
