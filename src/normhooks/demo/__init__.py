"""``normhooks demo``: the three papers' claims, measured over seeds on bundled data.

The command trains small CNNs on scikit-learn's bundled digits (or ``digits-hard``, the
same images each warped by a fixed random affine map and noised, or a ``.npz`` file) to
compare, side by side:

1. SGD at a small and a large batch, and at the large batch with
   :class:`~normhooks.GradientLARS` (You et al. 2017);
2. BatchNorm at a normal batch and at batch 2, GroupNorm and GroupNorm + weight
   standardization at batch 2 (Qiao et al. 2019);
3. a plain network, :func:`~normhooks.apply_weight_norm` with
   :func:`~normhooks.data_dependent_init`, and weight norm alone (Salimans & Kingma 2016).

Every configuration runs over several seeds, in parallel processes. The command prints the
mean and 95 % interval of each metric, and for each claim the paired difference over seeds,
its interval and a verdict (reproduced, contradicted or inconclusive; the rule is
:func:`.stats.verdict`). It writes ``results.json`` (every seed's numbers) and one PNG of
mean curves with shaded intervals per experiment. Its dependencies (scikit-learn,
matplotlib, tqdm) are the ``normhooks[demo]`` extra and are imported only when it runs.

Modules: :mod:`.cli` (arguments, checks, the run), :mod:`.data` (loading, distorting,
splitting), :mod:`.models` (the CNN), :mod:`.training` (one run's training loop),
:mod:`.experiments` (the recipes and the claims), :mod:`.stats` (intervals and the verdict
rule), :mod:`.runner` (the runs over seeds, in worker processes), :mod:`.report` (tables,
JSON, plots, writing them in place), :mod:`.errors` (the error reported as one line).
"""
