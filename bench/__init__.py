"""The benchmarks behind `make bench` (`python -m graphfit.bench`): each module measures one
claim side by side and writes JSON and plots under ``RESULTS_DIR`` (``out/bench/``, which git
ignores), never into the checkout's tracked files. The recorded runs that `bench/RESULTS.md`
cites live in ``bench/results/``: a maintainer copies a run there to record it."""

RESULTS_DIR = "out/bench"
