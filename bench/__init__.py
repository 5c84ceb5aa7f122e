"""The benchmarks behind `make bench` (`python -m graphfit.bench`): each module measures one
claim side by side and writes JSON and plots under `bench/results/`."""
