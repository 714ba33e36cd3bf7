"""The ops as torch custom ops: fake implementations and torch.compile(fullgraph=True) tracing, on the CPU (the
kernels themselves need the GPU: tests/test_gdn_sm90.py and tests/test_decode.py run them)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_kernels as ck


def _linear_inputs(B, T, H, kda=False, device="cpu"):
    q, k, v = (torch.randn(B, T, H, 128, dtype=torch.bfloat16, device=device) for _ in range(3))
    g = -torch.rand((B, T, H, 128) if kda else (B, T, H), device=device)
    beta = torch.rand(B, T, H, dtype=torch.bfloat16, device=device)
    return q, k, v, g, beta


@pytest.mark.parametrize("kda", [False, True])
def test_fake_linear_attention_shapes(kda):
    op = torch.ops.cute_kernels.chunk_kda if kda else torch.ops.cute_kernels.chunk_gated_delta_rule
    with FakeTensorMode():
        q, k, v, g, beta = _linear_inputs(1, 300, 4, kda)
        o, final = op(q, k, v, g, beta, None, None, True, torch.tensor([0, 100, 300], dtype=torch.int32), False)
        assert o.shape == (1, 300, 4, 128) and o.dtype == torch.bfloat16
        assert final.shape == (2, 4, 128, 128) and final.dtype == torch.float32   # N = 2 sequences
        _, none = op(q, k, v, g, beta, 0.1, None, False, None, False)
        assert none.numel() == 0
        v2 = torch.randn(1, 300, 8, 128, dtype=torch.bfloat16)   # GVA: the state has v's heads
        g2 = -torch.rand((1, 300, 8, 128) if kda else (1, 300, 8))
        o2, final2 = op(q, k, v2, g2, beta.repeat(1, 1, 2), None, None, True, None, False)
        assert o2.shape == v2.shape and final2.shape == (1, 8, 128, 128)


def test_fake_decode_attention_shapes():
    with FakeTensorMode():
        q = torch.randn(3, 4, 32, 128, dtype=torch.float16)
        kv = torch.randn(3, 64, 8, 128, dtype=torch.float16)
        o, lse = torch.ops.cute_kernels.decode_attention(q, kv, kv, torch.zeros(3, dtype=torch.int32), None, None,
                                                         None, None)
        assert o.shape == q.shape and o.dtype == torch.float16
        assert lse.shape == (3, 4, 32) and lse.dtype == torch.float32


class _Traced(Exception):
    pass


def _trace(fn, *args):
    """The FX graph torch.compile(fullgraph=True) makes of fn(*args) (nothing runs: the backend stops there)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        raise _Traced

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert graphs, f"torch.compile did not reach the backend: {info.value!r}"
    return str(graphs[0].graph)


def test_compile_traces_the_custom_ops():
    def model(q, k, v, g, beta, s0):
        o, s = ck.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        o2, _ = ck.chunk_kda(q, k, o, g[..., None].expand(*g.shape, 128), beta)
        return o2.float().sum() + s.sum()

    q, k, v, g, beta = _linear_inputs(1, 64, 2)
    graph = _trace(model, q, k, v, g, beta, torch.zeros(1, 2, 128, 128))
    assert "cute_kernels.chunk_gated_delta_rule" in graph and "cute_kernels.chunk_kda" in graph

    def decode(q, kc, vc, lens):
        return ck.decode_attention(q, kc, vc, lens, return_lse=True)[1].sum()

    kv = torch.randn(2, 32, 2, 128, dtype=torch.bfloat16)
    assert "cute_kernels.decode_attention" in _trace(decode, torch.randn(2, 8, 128, dtype=torch.bfloat16), kv, kv,
                                                    torch.tensor([5, 32], dtype=torch.int32))


def test_compile_traces_the_gate_arguments():
    """FLA's gate arguments are plain torch ops before the custom op: they trace with it (GVA shapes too)."""
    def model(q, k, v, g, beta, A_log, dt_bias):
        o, _ = ck.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                         use_beta_sigmoid_in_kernel=True)
        return o.float().sum()

    q, k, _, _, _ = _linear_inputs(1, 64, 2)
    v = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    graph = _trace(model, q, k, v, torch.randn(1, 64, 4), torch.randn(1, 64, 4), torch.zeros(4), torch.zeros(4))
    assert "cute_kernels.chunk_gated_delta_rule" in graph and "softplus" in graph and "sigmoid" in graph


def test_compile_traces_the_state_pool():
    def model(q, k, v, g, beta, pool, idx):
        o, _ = ck.chunk_kda(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx, final_state_indices=idx)
        return o.float().sum()

    q, k, v, g, beta = _linear_inputs(2, 64, 2, kda=True)
    graph = _trace(model, q, k, v, g, beta, torch.zeros(4, 2, 128, 128), torch.tensor([3, 0], dtype=torch.int32))
    for op in ("state_pool_gather", "cute_kernels.chunk_kda", "state_pool_scatter"):
        assert op in graph, op


def test_compile_rejects_a_scheduler_and_grad():
    from schedulers import SegmentScheduler

    q, k, v, g, beta = _linear_inputs(1, 64, 2)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="scheduler= is an eager-only argument"):
        torch.compile(lambda *a: ck.chunk_gated_delta_rule(*a, scheduler=SegmentScheduler(2))[0], fullgraph=True,
                      backend="eager")(q, k, v, g, beta)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="forward-only, but q requires grad"):
        torch.compile(lambda *a: ck.chunk_gated_delta_rule(*a)[0], fullgraph=True, backend="eager")(
            q.float().requires_grad_(), k, v, g, beta)


@pytest.mark.gpu(arch="sm_90a")
@pytest.mark.parametrize("kda", [False, True])
def test_compiled_equals_eager_on_the_gpu(kda):
    """torch.compile(fullgraph=True) with inductor runs the same kernels: outputs bitwise equal to eager."""
    torch.manual_seed(0)
    q, k, v, g, beta = _linear_inputs(2, 300, 4, kda, device="cuda")
    q, k = torch.nn.functional.normalize(q.float(), dim=-1).bfloat16(), torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    g = g * 0.05
    s0 = torch.randn(2, 4, 128, 128, device="cuda")
    fn = ck.chunk_kda if kda else ck.chunk_gated_delta_rule

    def model(q, k, v, g, beta, s0):
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        return o * 2, s

    torch._dynamo.reset()
    with torch.no_grad():
        want = model(q, k, v, g, beta, s0)
        got = torch.compile(model, fullgraph=True)(q, k, v, g, beta, s0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.isnan(got[0]).any()


@pytest.mark.gpu(arch="sm_90a")
def test_compiled_decode_equals_eager_on_the_gpu():
    torch.manual_seed(0)
    q = torch.randn(3, 32, 128, dtype=torch.bfloat16, device="cuda")
    kc, vc = (torch.randn(3, 1000, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    lens = torch.tensor([0, 1, 1000], dtype=torch.int32, device="cuda")

    def model(q, kc, vc, lens):
        o, lse = ck.decode_attention(q, kc, vc, lens, return_lse=True)
        return o + 1, lse

    torch._dynamo.reset()
    want = model(q, kc, vc, lens)
    got = torch.compile(model, fullgraph=True)(q, kc, vc, lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
