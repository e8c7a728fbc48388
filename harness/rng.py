"""The RNG streams verl saves per rank (extra_state["rng"]): cpu, numpy, random, and cuda when present."""

from __future__ import annotations

import random

STREAMS = ("cpu", "numpy", "random", "cuda")


def seed_rank(seed: int, rank: int) -> None:
    """Per-rank streams after the (shared) model init: distinct per rank, fixed per (seed, rank)."""
    import numpy as np
    import torch

    s = seed * 10_007 + rank + 1
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def get_rng_state() -> dict:
    import numpy as np
    import torch

    state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["cpu"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def numpy_safe_globals() -> list:
    """Exactly the globals np.random.get_state()'s tuple pickles through, for torch.load(weights_only=True)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    found = [_reconstruct, np.ndarray, np.dtype]
    dtype_cls = getattr(getattr(np, "dtypes", None), "UInt32DType", None)
    if dtype_cls is not None:
        found.append(dtype_cls)
    return found
