"""hvdx's version: the one place it is written (the package, setup.py, and the caches that
record which version wrote them read it here)."""

__version__ = "0.2.0"
