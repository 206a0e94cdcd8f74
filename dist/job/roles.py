"""Ranks and roles of a job: ranks 0..P1-1 are workers, P1..P1+P2-1 are KV-store servers.

The coordinator is not a rank of its own (it runs as a thread beside worker 0); messages name it
with the pseudo-rank COORDINATOR. Every error message about a peer goes through `role_name`, so a
user reads "server 1 (rank 5)" rather than a bare number.
"""
import os

COORDINATOR = -1


class Roles:
    def __init__(self, workers, servers):
        self.workers = int(workers)
        self.servers = int(servers)
        if self.workers < 1:
            raise ValueError(f"a job needs at least one worker, got {workers}")
        if self.servers < 0:
            raise ValueError(f"the number of servers cannot be negative, got {servers}")

    @property
    def size(self):
        return self.workers + self.servers

    def is_worker(self, rank):
        return 0 <= rank < self.workers

    def is_server(self, rank):
        return self.workers <= rank < self.size

    def role(self, rank):
        if rank == COORDINATOR:
            return "coordinator"
        return "worker" if self.is_worker(rank) else "server"

    def index(self, rank):
        """Index within the role: server ranks P1.. are servers 0.."""
        return rank if rank < self.workers else rank - self.workers

    def name(self, rank):
        """'worker 2', 'server 0 (rank 4)' or 'the coordinator (beside worker 0)'."""
        if rank == COORDINATOR:
            return "the coordinator (beside worker 0)"
        if self.is_worker(rank):
            return f"worker {rank}"
        if self.is_server(rank):
            return f"server {rank - self.workers} (rank {rank})"
        return f"rank {rank}"

    def short(self, rank):
        """'worker 2' / 'server 0' (no rank), for output prefixes and file names."""
        if rank == COORDINATOR:
            return "coordinator"
        return f"{self.role(rank)} {self.index(rank)}"

    def worker_ranks(self):
        return list(range(self.workers))

    def server_ranks(self):
        return list(range(self.workers, self.size))

    def server_rank(self, server_index):
        return self.workers + server_index


_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def rank_from_environment(environ=None):
    """(rank, variable name) from what mpirun or srun set, or (None, None)."""
    environ = os.environ if environ is None else environ
    for name in _RANK_VARIABLES:
        value = environ.get(name)
        if value not in (None, ""):
            return int(value), name
    return None, None
