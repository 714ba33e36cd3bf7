"""Worker for tests/test_distributed.py: `python tests/cp_worker.py WORLD METHOD KDA PORT` (gloo, CPU).

Spawns WORLD processes; each runs the context-parallel forward on its slice with the float64 reference backend;
rank 0 gathers the outputs and compares them with the single-process recurrent reference. Prints
`CP_OK <max relative error>` on success.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def inputs(kda):
    gen = torch.Generator().manual_seed(1234 + kda)
    B, T, H, K, V = 2, 333, 3, 16, 8
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn((B, T, H, K) if kda else (B, T, H), generator=gen, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, s0


def slice_bounds(T, world):
    # Unequal slices on purpose (the last rank gets the remainder), one of them not a multiple of 64.
    base = T // world
    return [r * base for r in range(world)] + [T]


def run(rank, world, method, kda, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from cute_kernels.distributed import chunk_gated_delta_rule_cp, chunk_kda_cp

    q, k, v, g, beta, s0 = inputs(kda)
    b = slice_bounds(q.shape[1], world)
    sl = slice(b[rank], b[rank + 1])
    fn = chunk_kda_cp if kda else chunk_gated_delta_rule_cp
    o, final = fn(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(), g[:, sl].contiguous(),
                  beta[:, sl].contiguous(), initial_state=s0 if rank == 0 else None, output_final_state=True,
                  method=method)
    # by value (numpy pickles its bytes): a torch tensor would go as a shared-memory handle that the parent can
    # only open while this process is alive, and it may already have exited
    queue.put((rank, o.numpy(), None if final is None else final.numpy()))
    dist.barrier()
    dist.destroy_process_group()


def main():
    world, method, kda, port = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
    from cute_kernels.reference import recurrent_gated_delta_rule

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, world, method, kda, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {r: (torch.from_numpy(o), None if f is None else torch.from_numpy(f))
               for r, o, f in (queue.get(timeout=300) for _ in range(world))}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    q, k, v, g, beta, s0 = inputs(kda)
    want_o, want_f = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o = torch.cat([results[r][0] for r in range(world)], dim=1)
    assert all(results[r][1] is None for r in range(world - 1)) and results[world - 1][1] is not None
    err_o = ((o - want_o).norm() / want_o.norm()).item()
    err_f = ((results[world - 1][1] - want_f).norm() / want_f.norm()).item()
    print(f"CP_OK {max(err_o, err_f):.3e}")


if __name__ == "__main__":
    main()
