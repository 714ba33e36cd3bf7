"""How each path of the chunked forward runs: runners built once per configuration (compiled kernels, tile tables
on the device) that then only allocate and launch. The planner (`cute_kernels.plan`) picks the path; the ops
(`cute_kernels.ops`) validate, plan and run."""


def plain_gate(device) -> tuple:
    """The kernels' gate arguments (a_log, dt_bias, lower_bound) when g and beta are read as given: 1-element
    stand-ins, made once per device."""
    hit = _plain_gates.get(device)
    if hit is None:
        import torch

        stand_in = torch.zeros(1, dtype=torch.float32, device=device)
        hit = _plain_gates[device] = (stand_in, stand_in, 0.0)
    return hit


_plain_gates: dict = {}
