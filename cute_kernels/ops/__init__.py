from .merge import affine_merge, lse_merge

__all__ = ["affine_merge", "lse_merge"]
