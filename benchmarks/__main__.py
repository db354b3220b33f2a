"""`make bench`: every workload, one table, written to docs/BENCHMARKS.md.

    python -m benchmarks            # everything (the memory workload runs 10,000 MLP steps)
    python -m benchmarks --quick    # 1,000 steps for the memory workload
"""

from __future__ import annotations

import datetime
import os
import platform
import sys

import tapegrad as tg
from benchmarks import cold_start, distributed, models, tape_append, workloads
from benchmarks._harness import Row


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def _machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def table(rows: list[Row]) -> str:
    lines = ["| workload | unit | tapegrad | torch | numpy | tapegrad/torch | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(f"| {r.workload} | {r.unit} | {_fmt(r.tapegrad)} | {_fmt(r.torch)} | "
                     f"{_fmt(r.numpy)} | {ratio} | {r.note} |")
    return "\n".join(lines)


def main() -> None:
    quick = "--quick" in sys.argv
    device = tg.default_device()
    torch_note = ("torch " + workloads.torch.__version__ if workloads.torch is not None
                  else "torch not installed: its columns are empty")
    print(f"device: {device}\n{torch_note}\n")
    rows: list[Row] = []
    for bench in (workloads.bench_mlp, workloads.bench_mlp_jit, workloads.bench_per_op,
                  workloads.bench_per_op_jit, workloads.bench_typed,
                  workloads.bench_elementwise,
                  workloads.bench_gemm, workloads.bench_cnn,
                  models.bench_gpt, models.bench_resnet, models.bench_lstm):
        result = bench()
        for row in result if isinstance(result, list) else [result]:
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    for row in workloads.bench_memory(1_000 if quick else 10_000):
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    # Each cold start is one sample of a noisy machine (2.3-2.9 s within minutes): the median
    # of three fresh processes, each with empty caches, and their range.
    colds = [cold_start.run(cold=True) for _ in range(3)]
    firsts = sorted(first for _, first, _ in colds)
    imp, first, builds = sorted(colds, key=lambda c: c[1])[1]
    rows.append(Row("first MLP step from a cold kernel cache (median of 3)", "s", first,
                    note=f"{firsts[0]:.2f}-{firsts[-1]:.2f} s; {builds} program builds; "
                         f"import {imp:.1f} s"))
    print(table([rows[-1]]).splitlines()[-1], flush=True)
    # The GPT step's first jitted call in a fresh process: with empty caches (every program
    # built, every kernel compiled by PoCL at its first run), then with the caches left on disk.
    for cold in (True, False):
        first, second, builds = cold_start.run_model("gpt", cold)
        caches = "empty" if cold else "warm"
        rows.append(Row(f"7. GPT: first tg.jit call in a fresh process, {caches} caches", "s",
                        first, note=f"{builds} program builds; the second call "
                                    f"{second * 1e3:.0f} ms"))
        print(table([rows[-1]]).splitlines()[-1], flush=True)
    appends = tape_append.run()
    n, _, per = appends[-1]
    rows.append(Row(f"tape: {n:,} appends along one line", "us/append", per,
                    note=", ".join(f"{k:,}: {p:.2f}" for k, _, p in appends)))
    # Processes of their own (mpiexec -n 2 and one plain), one PoCL thread each.
    for row in distributed.rows():
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    stamp = datetime.date.today().isoformat()
    text = (f"# Benchmarks\n\n`make bench` on {stamp}: {_machine()}.\n"
            f"Device: {device.name} ({device.platform_name}). {torch_note}.\n"
            "Times are medians after warm-up; the ratio is tapegrad/torch for times and "
            "torch/tapegrad for rates, so below 1 means tapegrad is faster.\n\n"
            + table(rows) + "\n")
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                       "BENCHMARKS.md")
    if os.path.exists(out):
        with open(out) as f:
            old = f.read()
        marker = "\n## Notes"
        if marker in old:
            text += old[old.index(marker):]
    with open(out, "w") as f:
        f.write(text)
    print("\n" + table(rows))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
