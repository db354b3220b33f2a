#!/usr/bin/env bash
# A GPU run through the device tool (docs/BENCHMARKS.md): the test suite and the jit and model
# rows through NVIDIA's OpenCL, PyTorch CUDA beside them. Run from the repository root with
# the wheels of what the machine lacks in .whl/ (pyopencl, optree, beartype and their needs);
# the log goes to $OUT/gpu.log.
set -u
log=${OUT:-/tmp}/gpu.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
# pyopencl's wheel carries an ICD loader: give it a vendors folder naming only the driver's
# OpenCL library (OCL_ICD_FILENAMES was not honoured there; the image's own PoCL was used).
mkdir -p /tmp/ocl-vendors
for lib in /usr/lib/libnvidia-opencl.so.1 /usr/local/nvidia/lib64/libnvidia-opencl.so.1 \
           /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1; do
  [ -e "$lib" ] && echo "$lib" > /tmp/ocl-vendors/nvidia.icd && break
done
export OCL_ICD_VENDORS=/tmp/ocl-vendors
{
  nvidia-smi -L
  python3 -c "import tapegrad as tg; print(tg.default_device())"
  # The whole pytest log comes back beside gpu.log; up to 25 failures are listed, so one run
  # of the lent minutes shows them all rather than the first.
  # pyright, MPI and import-linter's graph (grimp) are not on that image, and none is a device's.
  timeout "${TESTS_S:-240}" python3 -m pytest -q -rf --maxfail=25 -n 8 -p no:cacheprovider \
      ${TESTS:-tests} --ignore=tests/test_pyright_programs.py \
      --ignore=tests/test_distributed.py --ignore=tests/test_structure.py \
      > "${OUT:-/tmp}/pytest.log" 2>&1
  tail -40 "${OUT:-/tmp}/pytest.log"
  TAPEGRAD_BENCH_TORCH_DEVICE=cuda timeout "${BENCH_S:-240}" python3 -c '
from benchmarks import models, workloads
from benchmarks.__main__ import table
rows = [workloads.bench_mlp_jit(), workloads.bench_per_op_jit()]
for bench in (models.bench_gpt, models.bench_resnet, models.bench_lstm):
    rows += bench()
print(table(rows))
'
} 2>&1 | tee "$log"
