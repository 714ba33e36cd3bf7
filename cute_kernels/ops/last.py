"""`last_plan()`: how the last op call, of any op, split its work and why."""

from __future__ import annotations

_explain = None   # a zero-argument callable returning the last call's explanation


def record(explain) -> None:
    """Called by every op with a callable that explains its call (evaluated only when asked)."""
    global _explain
    _explain = explain


def last_plan() -> str | None:
    """The explanation of the last chunk_gated_delta_rule / chunk_kda / decode_attention call, or None."""
    return None if _explain is None else _explain()
