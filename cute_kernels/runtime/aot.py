"""Compiled kernels kept on disk, so a process can skip the JIT compile of a kernel an earlier process, or another
machine of the same arch, has already built.

Off unless `CUTE_KERNELS_AOT_DIR` names a directory. Then `compile_kernel` first looks there for an object file
named by a hash of (the compile key with its arch, the CuTe DSL version, every source file of `cute_kernels` and
`schedulers`: never a stale build) and loads it; on a miss it compiles, and with `CUTE_KERNELS_AOT_WRITE=1` exports
the result there. Any failure to load falls back to compiling.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from functools import lru_cache
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]   # the repository: cute_kernels/ and schedulers/ below it


def directory() -> Path | None:
    """The AOT directory (CUTE_KERNELS_AOT_DIR), or None: off."""
    d = os.environ.get("CUTE_KERNELS_AOT_DIR")
    return Path(d) if d else None


def writing() -> bool:
    return directory() is not None and os.environ.get("CUTE_KERNELS_AOT_WRITE", "0") == "1"


@lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of every .py file of the two packages and the CuTe DSL version (once per process)."""
    from importlib import metadata

    try:
        version = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        version = "?"
    h = hashlib.sha256(version.encode())
    for pkg in ("cute_kernels", "schedulers"):
        for path in sorted((_ROOT / pkg).rglob("*.py")):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def entry_name(full_key: tuple) -> str:
    """The object file's stem and exported function name of one compile key."""
    return "ck_" + hashlib.sha256((repr(full_key) + source_hash()).encode()).hexdigest()[:32]


def load(full_key: tuple):
    """The compiled function of `full_key` from the AOT directory, or None (off, absent, or not loadable)."""
    d = directory()
    if d is None:
        return None
    name = entry_name(full_key)
    path = d / f"{name}.o"
    if not path.is_file():
        return None
    try:
        import cutlass.runtime as rt

        return getattr(rt.load_module(str(path), enable_tvm_ffi=True), name)
    except Exception:   # a file this DSL cannot load: compile instead
        return None


def save(full_key: tuple, fn) -> None:
    """Export a freshly compiled function into the AOT directory (CUTE_KERNELS_AOT_WRITE=1); written to a temporary
    file first, so a reader never sees a partial one."""
    if not writing():
        return
    d = directory()
    d.mkdir(parents=True, exist_ok=True)
    name = entry_name(full_key)
    fd, tmp = tempfile.mkstemp(suffix=".o", dir=d)
    os.close(fd)
    try:
        fn.export_to_c(tmp, function_name=name)
        os.replace(tmp, d / f"{name}.o")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
