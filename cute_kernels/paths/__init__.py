"""How each path of the chunked forward runs: runners built once per configuration (compiled kernels, tile tables
on the device) that then only allocate and launch. The planner (`cute_kernels.plan`) picks the path; the ops
(`cute_kernels.ops`) validate, plan and run."""
