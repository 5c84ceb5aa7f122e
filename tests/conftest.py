"""Run the suite with oneDNN's graph passes off, unless ``TF_ENABLE_ONEDNN_OPTS`` says otherwise.

TF turns them on by default only on a CPU with AVX-512, and the machines CI runs on differ:
without this the same suite would test two runtimes on two machines. Several tests are of the
default kernels (the kernel passes, which step aside under oneDNN; the remapper's fusions;
the allocator's statistics), and under oneDNN on an AVX-512 VM (2026-12-06) seven of them
failed and a hand-made Conv2D + BiasAdd graph with control edges aborted TF (the merge
``tests/test_remat_onednn.py`` describes). That file runs the rewrite with oneDNN on and off
in subprocesses, whatever is set here. TF reads the variable when it loads, so it is set
before any test module imports TF.
"""

import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
