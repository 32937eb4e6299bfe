"""The experiment kit behind ``repro/``: data sets in their official layouts, embedding
networks, the :class:`Trainer`, evaluation of a run, plots and result tables.

The library (``nnkloss.ops``, ``.losses``, ``.bank``, ``.evaluation``) never imports this
subpackage; it builds on them.

- :mod:`.datasets`: loaders of local files (nothing is downloaded): the image sets in their
  official layouts, CUB200 (CUB-200-2011), Cars196, Flowers102, Leafsnap
  (:class:`ImageListDataset`); the IDX (MNIST-format) sets FashionMNIST, MNIST, KMNIST
  (:class:`IDXDataset`, :func:`read_idx`); IndexedTensorDataset (in-memory tensors) and
  stratified_split; every item is ``(input, label, idx)``;
- :mod:`.models`: embedding networks (torchvision backbones, DigitsNet) and a softmax head;
- :mod:`.train`: :class:`Trainer` / :func:`fit` (refresh schedule, AMP, logs, checkpoints);
- :mod:`.tuning`: :func:`choose_sigma` (the kernel width by validation loss, before training);
- :mod:`.setup`: the shared set-up of the reproduction scripts (loaders, criteria);
- :mod:`.evaluate`: embeddings of a loader, retrieval (Recall@K, MAP@R, R-precision from one
  search, NMI) and classification metrics of a run;
- :mod:`.plots`, :mod:`.reporting`: pictures, results.json and markdown tables.
"""
from .train import Trainer, fit, seed_everything
from .tuning import choose_sigma

__all__ = ["Trainer", "fit", "seed_everything", "choose_sigma"]
