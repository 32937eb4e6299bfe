"""Seeds: the range a user's seed must lie in, and the streams derived from it.

A seed names one random stream, and two seeds must never name the same one. The global
generators take different ranges (NumPy's legacy ``np.random.seed``, scikit-learn's
``random_state``: [0, 2**32); ``np.random.default_rng``: no negatives; Python's ``random.seed``:
a negative seed is its absolute value; torch: 64 bits, a negative one wrapped), so a user's seed
is checked to lie in [0, 2**32), where every one of them takes it unchanged. Taken modulo 2**32
(as before) seed -1 was seed 2**32 - 1 and seed 2**32 was seed 0.

A stream derived from a seed and further numbers (the Trainer's epoch and rank, on ranks
other than 0) is drawn from ``np.random.SeedSequence`` over the whole key, of fixed length and
each part below 2**32 (so that no two keys are one word list): distinct keys give distinct
streams, where the former ``seed * 1_000_003 + epoch + 1_000_000_007 * rank`` modulo 2**32 gave
seed s on rank 1 the stream of seed s + 482453229 on rank 0, every epoch. Rank 0 (and a single
process) keeps ``seed * 1_000_003 + epoch`` modulo 2**32, the streams of the published runs
(``nnkloss.experiment.train``).
"""
from __future__ import annotations

import argparse
import random

import numpy as np
import torch

__all__ = ["SEED_LIMIT", "check_seed", "seed_arg", "seed_everything"]

#: User seeds are integers in [0, SEED_LIMIT).
SEED_LIMIT = 2 ** 32


def check_seed(seed, name: str = "seed") -> int:
    """``seed`` as an int if it is an integer in [0, 2**32); else ValueError naming ``name``."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= int(seed) < SEED_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2**32), got {seed!r}")
    return int(seed)


def seed_arg(text: str) -> int:
    """argparse ``type`` of a seed option: argparse's error then names the option."""
    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}"
                                         ) from None


def seed_everything(seed: int, *stream: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and all CUDA devices) global RNGs.

    ``seed`` (checked: [0, 2**32)) alone seeds them with itself, as always. With ``stream``
    (integers in [0, 2**32), e.g. an epoch and a rank) they get the stream of the key
    ``(seed, *stream)``: 128 bits of its SeedSequence for Python and NumPy, 64 for torch. Keys of
    one length never share a stream; give the same number of parts for one family of streams.
    """
    seed = check_seed(seed)
    if not stream:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device
        return
    key = [seed] + [check_seed(v, f"seed_everything's stream part {i}")
                    for i, v in enumerate(stream)]
    # The key's length first: SeedSequence pads its entropy with zeros, so (s, e) and
    # (s, e, 0) would otherwise be one stream.
    words = np.random.SeedSequence([len(key)] + key).generate_state(4, np.uint32)
    random.seed(int.from_bytes(words.tobytes(), "little"))
    np.random.seed(words)
    torch.manual_seed(int(words[0]) | (int(words[1]) << 32))
