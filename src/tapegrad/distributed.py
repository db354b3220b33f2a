"""Data parallelism over MPI: the same script on N processes (`mpiexec -n N python train.py`),
gradients averaged across them.

    grads = tg.distributed.allreduce(grads)            # the mean over the ranks, every rank
    params = tg.distributed.broadcast(params, root=0)  # root's values everywhere

Installed with `pip install "tapegrad[mpi]"` (mpi4py and MPICH); with one process and no MPI
installed every call works (`size()` is 1). `_distributed` holds the implementation.
"""

from ._distributed import allreduce as allreduce
from ._distributed import broadcast as broadcast
from ._distributed import init as init
from ._distributed import local_rank as local_rank
from ._distributed import rank as rank
from ._distributed import size as size

__all__ = ["allreduce", "broadcast", "init", "local_rank", "rank", "size"]
