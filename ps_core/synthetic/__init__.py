"""Synthetic click streams with a known ground truth, and profiles shaped like real CTR logs.

Holds `SyntheticStream` (the generator: events in the event format, each with
its true click probability), `bayes_logloss`, the declared-field parts
(`CategoricalField`, `NumericField`, `Pair`) and the named profiles
(`PROFILES`, `profile_stream`): Criteo-, Avazu- and RTB-shaped streams, a weak
one and a drifting one.

May import: numpy only (nothing of the project: a stream is plain data, used
by producers, tests and benchmarks alike).
"""

from .fields import CategoricalField, NumericField, Pair
from .profiles import PROFILES, Profile, profile_stream
from .stream import BLOCK, SyntheticStream, bayes_logloss

__all__ = [
    "BLOCK",
    "PROFILES",
    "CategoricalField",
    "NumericField",
    "Pair",
    "Profile",
    "SyntheticStream",
    "bayes_logloss",
    "profile_stream",
]
