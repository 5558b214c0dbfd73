"""The former name of `hvdx.mpi_defaults` (which launcher started the rank; Open MPI told to
yield while it waits where ranks outnumber cores), kept so that users' imports keep working."""
from hvdx.mpi_defaults import (MPI_DEFAULTS, LaunchInfo, MachineFacts, apply_mpi_defaults, detect, machine_facts, oversubscription_warning, usable_cores)

__all__ = ["MPI_DEFAULTS", "LaunchInfo", "MachineFacts", "apply_mpi_defaults", "detect", "machine_facts", "oversubscription_warning", "usable_cores"]
