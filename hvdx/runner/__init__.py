"""Launching Horovod jobs on emulated topologies, one module per concern:

- hosts: horovodrun host lists that make one machine several nodes (`hosts(2, 2)`);
- launch: the launchers' command lines (`horovodrun_command`, `cluster_command`) and
  `run`, which runs a job under a timeout and kills its process tree when it expires;
- the emulated cloud cluster (docs/cluster.md; root): netns (namespaces, veth pairs,
  addresses, cleanup), shaping (tc), probe (link measurements), cluster (composes them
  and places the ranks with horovodrun's Gloo environment), cli (`python -m hvdx.runner`,
  also `python hvdx/runner/cluster.py`; `--mpi` runs the ranks under mpirun);
- MPI and SLURM (docs/launching.md): mpi (mpirun, horovodrun --mpi and srun command lines,
  nodes emulated for mpirun with uts_agent.sh, which rank failed), slurm (a throwaway SLURM
  cluster on one machine for srun and sbatch).

Nothing here imports TensorFlow; the cluster imports Horovod's launcher parts only.
"""
from .hosts import NODE_NAMES, host_list, hosts
from .launch import Finished, cluster_command, horovodrun_command, kill_tree, run

__all__ = ["NODE_NAMES", "Finished", "cluster_command", "horovodrun_command", "host_list", "hosts", "kill_tree", "run"]
