"""int8 block floating point: a block of weights as int8 codes and one
power-of-two exponent, a weight being ``code * 2**exp``.

The one home of the rule both int8 forms of weights follow: a replica's
read-only table (`ps_core.replica.read_table`, blocks are key buckets) and an
int8 serving file (`ps_core.checkpoint.serving_files`, blocks are runs of
rows). A push's int8 frame (`ps_core.net.quantize`) is another format: a
float32 scale per block, not a power of two.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["NO_EXP", "block_exponents", "block_codes"]

NO_EXP = -126
"""The exponent of a block of zeros only: any scale reads them as 0."""
_MIN_EXP, _MAX_EXP = -126, 127


def block_exponents(top: npt.NDArray[np.floating]) -> npt.NDArray[np.int32]:
    """For each block's largest magnitude `top`, the smallest exponent e with
    top / 2**e <= 127 (`NO_EXP` for 0), within int8's -126..127."""
    exps = np.full(top.shape, NO_EXP, dtype=np.int32)
    nz = top > 0
    exps[nz] = np.ceil(np.log2(top[nz] / 127.0)).astype(np.int32)
    # log2 rounds: where 127 * 2**e still falls short of top, one more.
    exps[nz] += (np.ldexp(np.float32(127), exps[nz]) < top[nz]).astype(np.int32)
    np.clip(exps, _MIN_EXP, _MAX_EXP, out=exps)
    return exps


def block_codes(values: npt.NDArray[np.float32], row_exps: npt.NDArray[np.int32]) -> npt.NDArray[np.int8]:
    """The int8 codes of `values` (n, dim), row i on the grid 2**row_exps[i]
    (nearest; -127..127)."""
    return np.clip(np.rint(np.ldexp(values, -row_exps[:, None])), -127, 127).astype(np.int8)
