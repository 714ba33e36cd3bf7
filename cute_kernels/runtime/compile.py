"""Compile once per (kernel, config, static shapes, arch), cache, call with torch tensors (TVM-FFI).

Kernels are compiled against fake tensors (no GPU needed): dynamic sizes become runtime arguments, static ones are
baked in. The compiled function takes torch tensors and launches on torch's current stream.
`CUTE_KERNELS_DUMP_DIR`, when set, keeps each compiled variant's PTX and cubin there. `CUTE_KERNELS_AOT_DIR`
(`runtime/aot.py`) keeps compiled kernels on disk between processes and machines of the same arch.
"""

from __future__ import annotations

import glob
import os
import struct
import tempfile
import threading
from dataclasses import dataclass

from . import aot
from .arch import import_cutlass, target_arch

_cache: dict = {}
_lock = threading.Lock()

DYN = None  # a dynamic extent in `fake_tensor` shapes


def _makedirs(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def cutlass_dtype(torch_dtype):
    import torch

    cutlass = import_cutlass()
    table = {
        torch.float32: cutlass.Float32,
        torch.float16: cutlass.Float16,
        torch.bfloat16: cutlass.BFloat16,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
    }
    if torch_dtype not in table:
        raise TypeError(f"no CuTe DSL type for {torch_dtype}")
    return table[torch_dtype]


def fake_tensor(dtype, shape, align: int = 16):
    """A row-major fake tensor for `cute.compile`; `None` entries in `shape` are dynamic extents."""
    import_cutlass()
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    shape = tuple(cute.sym_int() if s is None else s for s in shape)
    order = tuple(reversed(range(len(shape))))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def fake_stream():
    import_cutlass()
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)


@dataclass
class Compiled:
    fn: object
    ptx_path: str | None = None
    cubin_path: str | None = None


def compile_kernel(key: tuple, build, dump_dir: str | None = None) -> Compiled:
    """Compile `kernel` against `fake_args` (`build()` returns both) once per key; the key must name everything
    that is static. A cache hit costs one dict lookup: nothing is built on the per-call path."""
    full_key = (os.environ.get("CUTE_DSL_ARCH") or target_arch(),) + key
    hit = _cache.get(full_key)
    if hit is not None and dump_dir is None:
        return hit
    import_cutlass()
    import cutlass.cute as cute

    dump_dir = dump_dir or os.environ.get("CUTE_KERNELS_DUMP_DIR")
    if not dump_dir:   # (a dump wants the PTX and cubin files of a real compile)
        fn = aot.load(full_key)
        if fn is not None:
            out = Compiled(fn)
            with _lock:
                _cache[full_key] = out
            return out

    kernel, fake_args = build()

    options = "--enable-tvm-ffi"
    if dump_dir:
        dump_dir = tempfile.mkdtemp(prefix="variant_", dir=_makedirs(dump_dir))
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    fn = cute.compile(kernel, *fake_args, options=options)
    aot.save(full_key, fn)
    out = Compiled(fn)
    if dump_dir:
        out.ptx_path = next(iter(sorted(glob.glob(os.path.join(dump_dir, "*.ptx")))), None)
        out.cubin_path = next(iter(sorted(glob.glob(os.path.join(dump_dir, "*.cubin")))), None)
    with _lock:
        _cache[full_key] = out
    return out


def cubin_register_counts(path: str) -> dict[str, int]:
    """Registers per kernel, read from a cubin (ELF): EIATTR_REGCOUNT records of the `.nv.info` section."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return {}
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = {}
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    shstr = headers[shstrndx]
    for h in headers:
        name = data[shstr[4] + h[0] : data.index(b"\0", shstr[4] + h[0])].decode()
        sections[name] = data[h[4] : h[4] + h[5]]
    strtab, symtab = sections.get(".strtab", b""), sections.get(".symtab", b"")
    symbols = []
    for i in range(0, len(symtab), 24):
        off = struct.unpack_from("<I", symtab, i)[0]
        symbols.append(strtab[off : strtab.index(b"\0", off)].decode())
    info, i, out = sections.get(".nv.info", b""), 0, {}
    while i + 4 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == 4:  # EIFMT_SVAL: u16 size, payload
            size = struct.unpack_from("<H", info, i + 2)[0]
            if attr == 0x2F and size == 8:  # EIATTR_REGCOUNT: (symbol index, registers)
                sym, regs = struct.unpack_from("<II", info, i + 4)
                if sym < len(symbols):
                    out[symbols[sym]] = regs
            i += 4 + size
        elif fmt == 1:
            i += 2
        else:
            i += 4
    return out


def cuobjdump_path() -> str | None:
    """cuobjdump: on PATH, or from the `nvidia-cuda-cuobjdump` wheel (the test extra installs it)."""
    import shutil

    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump")))
        if hits:
            return hits[-1]
    return None


def cubin_resource_usage(path: str) -> dict[str, int] | None:
    """cuobjdump's resource usage of a cubin's kernel(s), summed (REG, STACK, SHARED, LOCAL, ...): STACK or LOCAL
    above 0 means register spills or local arrays. None when cuobjdump is not installed."""
    import re
    import subprocess

    tool = cuobjdump_path()
    if tool is None:
        return None
    text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    usage: dict[str, int] = {}
    for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text):
        usage[key] = usage.get(key, 0) + int(value)
    return usage
