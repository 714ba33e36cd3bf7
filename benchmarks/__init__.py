"""Benchmark harness: ``python -m benchmarks.sweep --op {kda,gdn,decode} --grid {seed,small,large}``.

Modules:
    grids     -- the (B, H, T) grids swept.
    roofline  -- bytes / FLOPs per cell and the roofline floor.
    ops       -- input builders and the "ours" / peer callables per op.
    report    -- speed-up tables, JSON and the heatmap (pure functions of the row dicts).
    sweep     -- the CLI and the timing loop (needs a CUDA GPU).
    decode    -- decode attention's sweep (``--op decode``): its grid, peers (SDPA, FA4, FlashInfer), plots.
"""
