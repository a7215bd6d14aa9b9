"""A fixed sample of tests/shapes_fuzz.py's random medium-sized calls (every op's draw at least twice), each judged
by its op test's rule; and the runner's replay: a case's seed draws the same call again."""

from __future__ import annotations

import random

import pytest
import shapes_fuzz as fz

SAMPLE = 12  # cases per op


@pytest.mark.parametrize("op", fz.OPS)
def test_a_fixed_sample_passes(op):
    rng = random.Random(f"shapes-fuzz-{op}")
    for _ in range(SAMPLE):
        seed = rng.randrange(2**32)
        desc, why = fz.run_case(seed, (op,))
        assert why is None, f"case {seed} ({desc}): {why}"


def test_a_case_seed_replays_its_call():
    seeds = fz.case_seeds(7)
    first = [next(seeds) for _ in range(5)]
    again = fz.case_seeds(7)
    assert first == [next(again) for _ in range(5)]
    for s in first[:2]:
        for op in ("fa", "row"):
            assert fz.CASES[op](random.Random(s))[0] == fz.CASES[op](random.Random(s))[0]


def test_the_runner_reports_a_failing_case(monkeypatch, capsys):
    def broken(rng):
        rng.random()
        return "broken op", lambda: (_ for _ in ()).throw(AssertionError((1.0, 0.1)))

    monkeypatch.setitem(fz.CASES, "fa", broken)
    assert fz.main(["--cases", "2", "--seed", "3", "--ops", "fa"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL case ") == 2 and "broken op: AssertionError: (1.0, 0.1)" in out
    assert "2 cases, 2 failed" in out
    seed = int(out.split("FAIL case ")[1].split(":")[0])
    assert fz.main(["--case", str(seed), "--ops", "fa"]) == 1
    assert f"case {seed}: broken op: AssertionError" in capsys.readouterr().out
