"""tg.distributed across processes: tests/distributed_worker.py run under `mpiexec -n 2` (the
mpiexec of the environment's MPI, which `make test` installs with the mpi extra), as one plain
process, and as one process that cannot import mpi4py.

Each run is bounded: ranks give up on a collective after TAPEGRAD_DISTRIBUTED_TIMEOUT seconds,
and a run past RUN_LIMIT is killed with its process group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tapegrad as tg

WORKER = Path(__file__).with_name("distributed_worker.py")
RUN_LIMIT = 120  # seconds for a whole run (first runs build kernels: a few seconds)
COLLECTIVE_TIMEOUT = "20"  # seconds a rank waits in one collective


def _mpiexec() -> str | None:
    """The launcher of the MPI that mpi4py loads here: the environment's own first (the mpich
    wheel puts it beside python), else one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
needs_mpiexec = pytest.mark.skipif(
    MPIEXEC is None, reason='no mpiexec: pip install "tapegrad[mpi]" (make test installs it)')


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    """Run `args` with one PoCL thread per process (2 ranks on 2 cores), killing its whole
    process group (mpiexec and its ranks) past RUN_LIMIT."""
    full_env = {**os.environ, "POCL_MAX_PTHREAD_COUNT": "1",
                "TAPEGRAD_DISTRIBUTED_TIMEOUT": COLLECTIVE_TIMEOUT, **(env or {})}
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=full_env, cwd=cwd, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=RUN_LIMIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"{' '.join(args)} ran past {RUN_LIMIT} s:\n{out}")
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def _logs(args: list[str], folder: Path, ranks: int, env: dict[str, str] | None = None
          ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the worker with `args`; its output and what each of `ranks` ranks reported."""
    run = _run(args, env={"WORKER_LOG_DIR": str(folder), **(env or {})})
    logs = [(folder / f"rank{r}.txt") for r in range(ranks)]
    return run, [log.read_text() if log.exists() else "" for log in logs]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """What each of two ranks reported of every check, run once."""
    assert MPIEXEC is not None
    run, logs = _logs([MPIEXEC, "-n", "2", sys.executable, str(WORKER), "checks"],
                      tmp_path_factory.mktemp("two_ranks"), 2)
    assert run.returncode == 0, run.stdout
    return logs


def _passed(logs: list[str], check: str) -> None:
    for r, log in enumerate(logs):
        assert f"ok {check}\n" in log, f"rank {r} reported:\n{log}"


@needs_mpiexec
def test_broadcast_gives_roots_values(two_ranks: list[str]) -> None:
    _passed(two_ranks, "broadcast")


@needs_mpiexec
def test_averaged_half_batch_gradients_equal_the_whole_batch_gradient(two_ranks: list[str]) -> None:
    """float64 to 1e-12 of the largest gradient, float32 to a few float32 roundings."""
    _passed(two_ranks, "float64 gradients")
    _passed(two_ranks, "float32 gradients")
    _passed(two_ranks, "backward's result")  # tg.backward's dict keyed by ids


@needs_mpiexec
def test_data_parallel_adam_equals_one_process_and_ranks_agree_bitwise(
        two_ranks: list[str]) -> None:
    """Twenty steps, float64, params compared after every step; every rank's params hash the
    same after every step."""
    _passed(two_ranks, "adam 20 steps")


@needs_mpiexec
def test_mismatched_trees_raise_on_every_rank_naming_the_leaf(two_ranks: list[str]) -> None:
    _passed(two_ranks, "mismatches")
    for log in two_ranks:
        assert ("tree['w']: rank 0 has float64 of shape (3, 2), rank 1 has float64 of shape "
                "(3, 3)" in log), log
    _passed(two_ranks, "after mismatches")


@needs_mpiexec
def test_a_rank_that_raises_stops_the_others_at_once(tmp_path: Path) -> None:
    """Its traceback, then MPI_Abort ends every rank: well before the collectives' timeout."""
    assert MPIEXEC is not None
    start = time.monotonic()
    run, logs = _logs([MPIEXEC, "-n", "2", sys.executable, str(WORKER), "dies"], tmp_path, 2)
    assert run.returncode != 0, run.stdout
    assert time.monotonic() - start < int(COLLECTIVE_TIMEOUT), run.stdout
    assert "RuntimeError: rank 1 fails on purpose" in run.stdout, run.stdout
    assert "MPI_Abort" in run.stdout, run.stdout
    assert logs == ["", ""], logs


@needs_mpiexec
def test_a_rank_that_never_comes_makes_the_others_raise_after_the_timeout(
        tmp_path: Path) -> None:
    assert MPIEXEC is not None
    start = time.monotonic()
    run, logs = _logs([MPIEXEC, "-n", "2", sys.executable, str(WORKER), "late"], tmp_path, 2,
                      env={"TAPEGRAD_DISTRIBUTED_TIMEOUT": "2"})
    assert run.returncode != 0, run.stdout
    assert logs[0].startswith("stopped after ") and "TAPEGRAD_DISTRIBUTED_TIMEOUT" in logs[0], (
        run.stdout)
    # rank 0's uncaught TapegradError ended rank 1 too, asleep for 30 s
    assert time.monotonic() - start < 25, run.stdout


def test_one_process_runs_the_same_script(tmp_path: Path) -> None:
    run, logs = _logs([sys.executable, str(WORKER), "checks"], tmp_path, 1)
    assert run.returncode == 0, run.stdout
    _passed(logs, "adam 20 steps")


# mpi4py made unimportable, then the worker run as a script.
_WITHOUT_MPI4PY = ("import runpy, sys; sys.modules['mpi4py'] = None; "
                   "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def test_one_process_without_mpi4py_runs_the_same_script(tmp_path: Path) -> None:
    run, logs = _logs([sys.executable, "-c", _WITHOUT_MPI4PY, str(WORKER), "checks"],
                      tmp_path, 1)
    assert run.returncode == 0, run.stdout
    _passed(logs, "broadcast")
    _passed(logs, "adam 20 steps")


def test_several_ranks_without_mpi4py_say_how_to_install_it() -> None:
    """A launcher's variables say there are 2 ranks: going on alone would train two copies."""
    run = _run([sys.executable, "-c", _WITHOUT_MPI4PY, str(WORKER), "checks"],
               env={"PMI_SIZE": "2"})
    assert run.returncode != 0
    assert "TapegradError" in run.stdout and 'pip install "tapegrad[mpi]"' in run.stdout, (
        run.stdout)


def test_bad_arguments_are_refused_before_any_message() -> None:
    with pytest.raises(tg.ShapeError, match="op must be 'mean' or 'sum'"):
        tg.distributed.allreduce({"g": np.ones(2)}, op="max")
    with pytest.raises(tg.DTypeError, match=r"tree\['i'\] is int64; op='mean' needs a float"):
        tg.distributed.allreduce({"i": np.ones(2, np.int64)})
    with pytest.raises(tg.ShapeError, match="root must be a rank"):
        tg.distributed.broadcast({"g": np.ones(2)}, root=tg.distributed.size())
    with pytest.raises(tg.DTypeError, match=r"tree\['s'\] must be an AnyTensor or an array"):
        tg.distributed.allreduce({"s": "text"})


def test_one_process_returns_the_tree_as_tensors() -> None:
    tree = {"a": np.arange(3.0), "b": (tg.AnyTensor(np.ones(2, np.float32)), None)}
    out = tg.distributed.allreduce(tree)
    assert isinstance(out["a"], tg.AnyTensor) and out["b"][1] is None
    assert np.array_equal(out["a"].numpy(), np.arange(3.0))
    assert out["b"][0] is tree["b"][0]
    assert tg.distributed.rank() == 0 and tg.distributed.local_rank() == 0


@needs_mpiexec
def test_the_data_parallel_demo_trains_and_rank_0_writes_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason='the demo needs pip install "tapegrad[demo]"')
    pytest.importorskip("matplotlib", reason='the demo needs pip install "tapegrad[demo]"')
    assert MPIEXEC is not None
    # One epoch (the argument), in a folder of its own: the demo writes out/ there.
    run = _run([MPIEXEC, "-n", "2", sys.executable, "-m", "tapegrad.demo.ddp", "1"],
               cwd=tmp_path)
    assert run.returncode == 0, run.stdout
    assert run.stdout.count("CNN x2 epoch  1/1 loss") == 1, run.stdout  # rank 0 alone prints
    assert (tmp_path / "out" / "ddp_loss.png").exists()
