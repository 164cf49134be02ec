"""Values the reference scripts and their C++ tests each compute from a name, a row and a column,
so that only configurations and results need committing (tests/ops/hashed_uniform.hpp is the
tests' side)."""

MASK64 = (1 << 64) - 1


def splitmix64(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def fnv1a64(text):
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & MASK64
    return h


def uniform(key, row, col):
    """v uniform in [-1, 1): splitmix64 of `key` (fnv1a64 of a name) plus the row and column, each
    times an odd constant, its top 24 bits."""
    x = splitmix64((key + row * 0x9E3779B97F4A7C15 + col * 0xC2B2AE3D27D4EB4F) & MASK64)
    return 2.0 * ((x >> 40) / float(1 << 24)) - 1.0
