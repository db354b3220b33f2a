"""The demos: a short digits run learns and writes its files, typed layers reject wrong shapes,
missing extras give the install command, the toy demo trains, and the README's training loop
runs and passes pyright strict."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tapegrad as tg
from tapegrad.demo import digits, toy

README = Path(__file__).parent.parent / "README.md"
PYRIGHT = Path(sys.executable).parent / "pyright"
LOSS_LINE = re.compile(r"loss (\d+\.\d+)")


def test_short_demo_run_learns_and_writes_its_files(tmp_path: Path) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        histories = digits.main(str(tmp_path), epochs=4)
    printed = out.getvalue()
    assert set(histories) == {"MLP", "CNN"}
    for name, history in histories.items():
        assert len(history.losses) == len(history.accuracies) == 4
        assert history.losses[-1] < history.losses[0] / 3, (name, history.losses)
        assert history.accuracies[-1] > 0.9, (name, history.accuracies)
        assert f"{name} epoch  4/4" in printed
        assert f"{name}: test accuracy {100 * history.accuracies[-1]:.1f}%" in printed
    with open(tmp_path / "digits_loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    drawings = [p for p in tmp_path.iterdir() if p.stem == "cnn_tape"]
    assert [p.suffix for p in drawings] in ([".svg"], [".dot"])
    drawing = drawings[0].read_text()
    # the recorded step: the forward's ops and the backward's, named leaves among them
    assert "conv" in drawing or "im2col" in drawing
    assert "cross_entropy" in drawing and "'images'" in drawing and "'c1'" in drawing
    assert str(drawings[0]) in printed


def test_typed_layer_rejects_a_wrong_shape() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((4, 64), np.float32))
    tape, w = tg.leaf(tape, np.ones((32, 10), np.float32))  # should be (64, ...)
    tape, b = tg.leaf(tape, np.ones(10, np.float32))
    with pytest.raises(Exception, match="fin"):
        digits.dense(tape, x, w, b)


def test_plot_writes_a_png_of_both_panels(tmp_path: Path) -> None:
    path = tmp_path / "curves.png"
    digits.plot({"MLP": digits.History([1.0, 0.5, 0.25], [0.8, 0.9, 0.95]),
                 "CNN": digits.History([1.2, 0.4], [0.7, 0.96])}, str(path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# A demo run in which `module` is not installed: a finder ahead of the others answers for it as
# the import system does for a missing package.
BLOCKED_RUN = """
import runpy, sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
runpy.run_module({demo!r}, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module", ["sklearn", "matplotlib"])
@pytest.mark.parametrize("demo", ["tapegrad.demo", "tapegrad.demo.digits"])
def test_missing_extras_say_how_to_install_them(module: str, demo: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN.format(module=module, demo=demo)], cwd=tmp_path,
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stderr
    assert 'pip install "tapegrad[demo]"' in done.stderr
    assert f"No module named '{module}" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ""  # nothing started before the check
    assert not (tmp_path / "out").exists()


def test_toy_demo_fits_and_its_gradients_check(capsys: pytest.CaptureFixture[str]) -> None:
    toy.main(steps=100)
    printed = capsys.readouterr().out
    losses = [float(v) for v in LOSS_LINE.findall(printed)]
    assert len(losses) == 3 and losses[-1] < losses[0] / 10, losses
    assert "gradients agree with float64 finite differences: ok" in printed


def _readme_training_loop() -> str:
    """The python block of the README's section "The training loop to copy"."""
    text = README.read_text()
    start = text.index("\n## The training loop to copy\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "the README's training-loop section has no python block"
    return block.group(1)


def test_readme_training_loop_runs_and_learns(capsys: pytest.CaptureFixture[str]) -> None:
    code = compile(_readme_training_loop(), f"{README}:The training loop to copy", "exec")
    namespace: dict[str, Any] = {"__name__": "readme_training_loop"}
    exec(code, namespace)
    losses = [float(v) for v in LOSS_LINE.findall(capsys.readouterr().out)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 100, losses
    assert set(namespace["params"]) == {"w1", "b1", "w2", "b2"}
    assert all(isinstance(v, tg.AnyTensor) for v in namespace["params"].values())


def test_readme_training_loop_passes_pyright_strict(tmp_path: Path) -> None:
    if not PYRIGHT.exists():
        pytest.skip(f"pyright is not installed next to {sys.executable}")
    (tmp_path / "loop.py").write_text(_readme_training_loop())
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(
        {"typeCheckingMode": "strict", "pythonVersion": "3.11",
         "reportMissingTypeStubs": False}))
    done = subprocess.run(
        [str(PYRIGHT), "--outputjson", "-p", str(tmp_path), "--pythonpath", sys.executable],
        capture_output=True, text=True, timeout=300, check=False)
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["summary"]["filesAnalyzed"] == 1
    found = [f"line {d['range']['start']['line'] + 1}: {d['message']}"
             for d in report["generalDiagnostics"]]
    assert not found, "\n".join(found)
