"""``normhooks demo``: the three papers' claims, measured on bundled data in a few minutes.

The command trains small CNNs on scikit-learn's bundled digits (or on a ``.npz`` file) to
compare, side by side:

1. large-batch SGD with and without :class:`~normhooks.GradientLARS` (You et al. 2017);
2. batch-2 training with BatchNorm, GroupNorm and GroupNorm + weight standardization
   (Qiao et al. 2019);
3. a plain network, :func:`~normhooks.weight_norm`, and weight norm with
   :func:`~normhooks.data_dependent_init` (Salimans & Kingma 2016).

It prints a results table with one verdict per claim, and writes ``results.json`` and one
PNG of training curves per experiment. Its dependencies (scikit-learn, matplotlib, tqdm) are
the ``normhooks[demo]`` extra and are imported only when the command runs.

Modules: :mod:`.cli` (arguments, checks, the run), :mod:`.data` (loading and splitting),
:mod:`.models` (the CNN), :mod:`.training` (one configuration's training loop),
:mod:`.experiments` (the three recipes and their verdict rules), :mod:`.report` (table,
JSON, plots, writing them in place), :mod:`.errors` (the error reported as one line).
"""
