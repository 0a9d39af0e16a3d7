"""Seeded randomness that gives the same numbers everywhere: numpy's raw PCG64 stream, not its samplers.

``convert --order shuffled`` and the block samplers both draw from here, so a seed means the same
order on every machine and numpy version.
"""

from __future__ import annotations

import numpy as np

from packer.errors import OptionError


def raw_draws(seed: int, *keys: int, n: int) -> np.ndarray:
    """``n`` uint64 draws from PCG64 seeded by (seed, *keys): stable across numpy versions."""
    if seed < 0 or any(k < 0 for k in keys):
        raise OptionError(f"seed and epoch must be non-negative integers, got seed={seed}, {keys}")
    return np.random.PCG64(np.random.SeedSequence([int(seed), *map(int, keys)])).random_raw(n)


def stable_permutation(n: int, seed: int, *keys: int) -> np.ndarray:
    """A random permutation of ``range(n)`` that depends only on (seed, *keys), not on numpy's version."""
    return np.argsort(raw_draws(seed, *keys, n=n), kind="stable")
