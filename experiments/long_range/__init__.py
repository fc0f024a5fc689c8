"""The long-range testbed (``python -m experiments.long_range``, :mod:`.main`): one module per step (train and ship,
evaluate, cost, demo) over the testbed's arms (:mod:`.arms`) and measurements (:mod:`.probes`)."""
