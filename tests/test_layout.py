"""The codebase's shape (CPU, no imports of the code): no import cycle, environment variables for infrastructure
only, no work-log text in the sources."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cute_kernels", "schedulers")
# The only environment variables the library reads: the on-disk compile cache, PTX dumps, the gate check, and the
# one user-facing override of the planner's path.
ALLOWED_ENV = {"CUTE_KERNELS_AOT_DIR", "CUTE_KERNELS_AOT_WRITE", "CUTE_KERNELS_DUMP_DIR", "CUTE_KERNELS_CHECK_GATES",
               "CUTE_KERNELS_PATH"}


def modules() -> dict[str, Path]:
    """Module name -> file, for every .py of the packages."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """The package modules `name` imports anywhere in its file (function-level imports included), resolved to
    module names; importing `a.b.c` also runs `a` and `a.b`, so those count too."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            parts = t.split(".")
            for i in range(1, len(parts) + 1):
                cand = ".".join(parts[:i])
                if cand in known and cand != name:
                    found.add(cand)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, or None. A package's own __init__ importing its submodules is not a cycle
    edge in reverse: an edge from a module to an ancestor package is dropped (Python runs the ancestor first)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if n.startswith(m + "."):
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                cyc = visit(m)
                if cyc:
                    return cyc
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cyc = visit(n)
            if cyc:
                return cyc
    return None


def test_no_import_cycle():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert graph["cute_kernels.ops.linear_attention"] >= {"cute_kernels.plan", "cute_kernels.paths.two_phase"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_sees_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"p": {"p.x"}, "p.x": {"p"}}) is None   # a submodule importing its package


def tracked(*paths) -> list[Path]:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *paths], cwd=ROOT, text=True,
                           capture_output=True, check=True).stdout.split()
    return [ROOT / f for f in files if (ROOT / f).is_file()]


def test_environment_variables_are_infrastructure_only():
    names = set()
    for f in tracked("cute_kernels", "schedulers", "benchmarks", "README.md"):
        if f.suffix in (".py", ".md", ".json", ".sh", ".txt"):
            names |= set(re.findall(r"CUTE_KERNELS_[A-Z0-9_]+", f.read_text(errors="replace")))
    assert names <= ALLOWED_ENV, sorted(names - ALLOWED_ENV)
    assert len(names) <= 6


def test_no_work_log_in_the_sources():
    """Sessions, dates and who measured what belong in commits and issue notes, not in the code."""
    bad = []
    for f in tracked(*PACKAGES):
        if f.suffix == ".py":
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if re.search(r"session \d+|20\d\d-\d\d-\d\d", line, re.IGNORECASE):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
    assert not (ROOT / "NOTES.md").exists()
    assert (ROOT / "docs" / "design.md").exists() and (ROOT / "docs" / "perf-history.md").exists()


def test_benchmark_results_stay_small():
    files = tracked("benchmarks/results")
    assert len(files) <= 40 and sum(f.stat().st_size for f in files) <= 4 * 2**20
