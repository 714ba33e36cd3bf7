"""GPU: the device scheduler hands every CTA exactly the tiles the host enumeration says."""

import pytest
from conftest import requires_gpu

from schedulers import PersistentScheduler, Problem, SegmentScheduler, SequenceScheduler


CASES = [
    ("sequence fixed", SequenceScheduler(), Problem.fixed(3, 1000, 4)),
    ("segment auto", SegmentScheduler(), Problem.fixed(1, 8192, 4)),
    ("segment varlen", SegmentScheduler(), Problem.varlen([0, 1, 64, 65, 129, 129 + 20000], 3)),
    ("segment forced", SegmentScheduler(num_segments=7, min_chunks=1), Problem.varlen([0, 63, 64 + 63, 5000], 2)),
    ("persistent", PersistentScheduler(), Problem.varlen([0, 100, 5000, 5100, 20000], 8)),
    ("persistent segments", PersistentScheduler(SegmentScheduler()), Problem.fixed(2, 16384, 4)),
]


@requires_gpu
@pytest.mark.parametrize("name,scheduler,problem", CASES, ids=[c[0] for c in CASES])
def test_probe_matches_host(name, scheduler, problem):
    from schedulers.probe import run_probe

    sm_count = 16 if "persistent" in name else 132  # a small persistent grid makes CTAs loop
    schedule = scheduler.schedule(problem, sm_count=sm_count, ctas_per_sm=2)
    got, count = run_probe(schedule)
    want = [[t.as_row() for t in tiles] for tiles in schedule.cta_work()]
    assert [len(w) for w in want] == count.tolist()
    assert got == want
