"""AdaFisher's curvature: Kronecker-factored Fisher statistics taken with module hooks.

Four sub-packages, each importing only those below it (an import-linter contract in
``.importlinter`` keeps the order):

- :mod:`~hf_triaccel.curvature.signals`: the per-module signals the precision controller
  and the step-size steering read from the factors.
- :mod:`~hf_triaccel.curvature.collector`: :class:`FisherCollector`, which puts the
  collection together for a model.
- :mod:`~hf_triaccel.curvature.collection`: the runtime: layers' factors, hooks, the fold
  over micro-batches and processes, sharded parameters.
- :mod:`~hf_triaccel.curvature.rules`: the rule API (which modules carry factors, how
  their statistics are taken and finished) and the reductions the rules write through.
"""
