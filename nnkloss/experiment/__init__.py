"""The experiment kit behind ``repro/``, built on the library (which never imports it).

- :mod:`.datasets`: local files only, items ``(input, label, idx)``: CUB200, Cars196,
  Flowers102, Leafsnap (:class:`ImageListDataset`); FashionMNIST, MNIST, KMNIST
  (:class:`IDXDataset`, :func:`read_idx`); IndexedTensorDataset; stratified_split;
- :mod:`.models`: embedding networks and a softmax head;
- :mod:`.train`: :class:`Trainer` / :func:`fit`; :mod:`.tuning`: :func:`choose_sigma`;
- :mod:`.setup`, :mod:`.evaluate`, :mod:`.plots`, :mod:`.reporting`: the scripts' set-up,
  metrics, pictures and result tables.
"""
from .train import Trainer, fit, seed_everything
from .tuning import choose_sigma

__all__ = ["Trainer", "fit", "seed_everything", "choose_sigma"]
