"""Launchers: `python -m hvdx.runner.cluster` runs a Horovod job on an emulated cloud
cluster (one network namespace per node, tc-shaped links between them; needs root)."""
