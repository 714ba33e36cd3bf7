"""Command line: `python -m cute_kernels compile --arch sm_90a|sm_100a|sm_103a [--op NAME] --out DIR`.

Compiles every kernel variant for the named arch without a GPU, writes `<variant>.<arch>.ptx` and
`.cubin` to DIR, checks the PTX for the instructions each variant must contain, and prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from .runtime.arch import SM100_ARCHS, SUPPORTED_ARCHS


def cmd_compile(args) -> int:
    if "cutlass" in sys.modules and os.environ.get("CUTE_DSL_ARCH") != args.arch:
        print("error: cutlass was imported before the arch was set", file=sys.stderr)
        return 2
    os.environ["CUTE_DSL_ARCH"] = args.arch
    from .runtime.compile import cubin_register_counts, cubin_resource_usage
    from .variants import all_variants

    variants = [v for v in all_variants(args.arch) if args.op in (None, v.op)]
    if not variants:
        print(f"error: no variant of op {args.op!r}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rows, failures = [], 0
    for v in variants:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            try:
                compiled = v.compile(tmp)
            except Exception as e:  # report every variant, then fail
                failures += 1
                rows.append((v.name, args.arch, "-", "-", "-", f"FAILED: {type(e).__name__}: {str(e)[:200]}"))
                continue
            secs = time.time() - t0
            if not compiled.ptx_path or not compiled.cubin_path:
                failures += 1
                rows.append((v.name, args.arch, "-", "-", "-", "FAILED: no PTX/cubin written"))
                continue
            ptx_out = os.path.join(args.out, f"{v.name}.{args.arch}.ptx")
            cubin_out = os.path.join(args.out, f"{v.name}.{args.arch}.cubin")
            shutil.copyfile(compiled.ptx_path, ptx_out)
            shutil.copyfile(compiled.cubin_path, cubin_out)
            ptx = open(ptx_out).read()
            missing = v.missing(args.arch, ptx)
            regs = cubin_register_counts(cubin_out)
            reg_text = "/".join(str(r) for r in regs.values()) or "?"
            usage = cubin_resource_usage(cubin_out)
            spill = "?" if usage is None else f"{usage.get('STACK', 0)}/{usage.get('LOCAL', 0)}"
            # SM100 builds must not spill (stack / local bytes 0); sm_90a reports it
            spills = args.arch in SM100_ARCHS and usage is not None and (usage.get("STACK", 0) or usage.get("LOCAL", 0))
            status = (f"ok ({secs:.1f}s)" if not missing and not spills else
                      f"MISSING {missing}" if missing else f"SPILLS (stack/local bytes {spill})")
            failures += bool(missing) or bool(spills)
            rows.append((v.name, args.arch, reg_text, spill, f"{len(ptx) / 1024:.1f} KiB", status))
    head = ("kernel", "arch", "regs", "stack/local B", "PTX", "status")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"{len(rows) - failures} compiled, {failures} failed -> {args.out}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_kernels")
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile every kernel variant for an arch (no GPU needed)")
    c.add_argument("--arch", required=True, choices=list(SUPPORTED_ARCHS))
    c.add_argument("--op", default=None, help="only this op (e.g. affine_merge, lse_merge)")
    c.add_argument("--out", required=True, help="directory for the .ptx and .cubin files")
    args = parser.parse_args(argv)
    return cmd_compile(args)


if __name__ == "__main__":
    sys.exit(main())
