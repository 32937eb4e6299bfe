"""The experiment kit behind ``repro/``, built on the library (which never imports it): data
sets from local files (:mod:`.datasets`: CUB200, Cars196, Flowers102, Leafsnap as
ImageListDataset; FashionMNIST, MNIST, KMNIST as IDXDataset; IndexedTensorDataset), networks
(:mod:`.models`), the :class:`Trainer`, :func:`choose_sigma`, and the scripts' set-up, metrics,
plots and result tables."""
from .train import Trainer, fit, seed_everything
from .tuning import choose_sigma

__all__ = ["Trainer", "fit", "seed_everything", "choose_sigma"]
