"""Development scripts. A package so that `python -m scripts.gpu_harness...` finds this
folder before any other top-level `scripts` package on sys.path."""
