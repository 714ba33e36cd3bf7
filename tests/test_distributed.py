"""Context parallel on the CPU: gloo, 2 and 4 processes, float64 reference backend (issue 6)."""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["allgather", "p2p"])
@pytest.mark.parametrize("kda", [False, True])
def test_cp_equals_single_process(world, method, kda):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "cp_worker.py"), str(world), method, str(int(kda)), str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    m = re.search(r"CP_OK (\S+)", proc.stdout)
    assert m, proc.stdout[-2000:]
    assert float(m.group(1)) <= 1e-10


def test_pick_method():
    from cute_kernels.distributed import ALLGATHER_MAX_BYTES, pick_method

    assert pick_method(2, 1, 4, 128, 128, 4) == "allgather"
    world = ALLGATHER_MAX_BYTES // (4 * 2 * 128 * 128 * 4) + 1
    assert pick_method(world, 1, 4, 128, 128, 4) == "p2p"


def test_needs_process_group():
    from cute_kernels.distributed import chunk_gated_delta_rule_cp

    x = torch.zeros(1, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="process group"):
        chunk_gated_delta_rule_cp(x, x, x, torch.zeros(1, 4, 1), torch.zeros(1, 4, 1))
