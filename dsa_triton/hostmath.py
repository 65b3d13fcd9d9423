"""Host-side integer helpers for launch code.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6: calling them from Python
costs microseconds each, which adds up in launch paths of a few microseconds.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), like ``triton.next_power_of_2``."""
    return 1 << (max(n, 1) - 1).bit_length()
