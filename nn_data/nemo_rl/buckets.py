"""``T`` buckets, the drop-ins' option (``cfg["nn_data"]["buckets"]``): a packed length learned from the data
rounded up to one of a few values, so a compiled graph sees few shapes."""

from __future__ import annotations

import math

from nn_data.nemo_rl.assertions import PackingAssertionError


def bucket_total(total: int, buckets, p: int, cp_size: int) -> int:
    """The smallest bucket that holds ``total`` (:attr:`PackOptions.buckets`; host ints).

    ``buckets`` is a sorted tuple of ints or ``"pow2"`` (``unit * 2**k`` with ``unit = lcm(p, 2C)``).
    Example: total 40, buckets ``(64, 128)`` -> 64; ``"pow2"`` with p 8, C 1 -> 8 * 2**3 = 64.
    """
    unit = math.lcm(p, 2 * cp_size) if cp_size > 1 else p
    if buckets == "pow2":
        return unit * (1 << max(0, math.ceil(math.log2(max(total, 1) / unit))))
    bad = [b for b in buckets if b % unit]
    if bad:
        raise PackingAssertionError(f"bucket {bad[0]} is not a multiple of {unit} (lcm of "
                                    f"pad_packed_seq_to_multiple_of={p} and 2*cp_size); every bucket must be one")
    for b in buckets:
        if b >= total:
            return b
    raise PackingAssertionError(f"the packed total {total} exceeds the largest bucket {buckets[-1]}; "
                                f"add a bucket of at least {total}")
