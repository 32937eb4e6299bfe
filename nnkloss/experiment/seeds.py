"""Seeds: integers in [0, 2**32), the range every global generator (Python, NumPy,
scikit-learn, torch) takes unchanged, so that two seeds never name one stream."""
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

    ``seed`` alone seeds them with itself; with ``stream`` (integers in [0, 2**32), e.g. an
    epoch and a rank) they get the stream of the key ``(seed, *stream)`` from its
    SeedSequence. Distinct keys never share a stream.
    """
    seed = check_seed(seed)
    if not stream:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device
        return
    key = [seed] + [check_seed(v, f"seed_everything's stream part {i}")
                    for i, v in enumerate(stream)]
    # The length first: SeedSequence pads with zeros ((s, e) would be (s, e, 0)).
    words = np.random.SeedSequence([len(key)] + key).generate_state(4, np.uint32)
    random.seed(int.from_bytes(words.tobytes(), "little"))
    np.random.seed(words)
    torch.manual_seed(int(words[0]) | (int(words[1]) << 32))
