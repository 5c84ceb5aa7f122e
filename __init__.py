"""graphfit: make a TensorFlow training step fit a memory budget and a set of devices.

The repository's top-level packages install under this one name (``graphfit.models``,
``graphfit.profiler``, ``graphfit.remat``, ``graphfit.baechi``, ``graphfit.pipeline``,
``graphfit.tools``, ``graphfit.bench``), so a user's own ``models.py`` or ``tools/`` is never
shadowed. Entry points: ``graphfit.pipeline.meta_optimizer`` (the pass pipeline) and
``python -m graphfit.tools.train``.
"""

__version__ = "0.1.0"
