"""A user's view of the package: tapegrad built as a wheel, installed (not editable) into a new
virtualenv, and pyright in strict mode with its default settings run over small user programs.
tests/typing/accept passes with no error; tests/typing/reject fails exactly where its
`# expect: <rule>[: message fragment]` comments say.

The project's own pyright config (pyproject.toml) sees `src/` as source code, so it cannot show
what an installed tapegrad looks like to a user (a missing `py.typed` is invisible to it)."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tapegrad as tg

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).parent / "typing"
ACCEPT = sorted((PROGRAMS / "accept").glob("*.py"))
REJECT = sorted((PROGRAMS / "reject").glob("*.py"))
PYRIGHT = Path(sys.executable).parent / "pyright"
EXPECT = re.compile(r"#\s*expect:\s*(\w+)(?::\s*(.+?))?\s*$", re.M)
# A user's project: strict, and nothing else changed from pyright's defaults.
USER_CONFIG = {"typeCheckingMode": "strict"}


@dataclass(frozen=True)
class Finding:
    line: int  # 1-based
    severity: str
    rule: str
    message: str


@dataclass(frozen=True)
class Installed:
    wheel: Path
    python: Path  # the new virtualenv's interpreter
    site: Path  # its site-packages, holding tapegrad


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel of this checkout, installed into a fresh virtualenv.

    Built without build isolation (setuptools comes with the dev extra), so no download per run.
    The new environment sees the dependencies of the test environment through a .pth file (a
    path line; the editable install's own .pth there is not read from it), so only tapegrad
    itself comes from the wheel."""
    if not PYRIGHT.exists():
        pytest.skip(f"pyright is not installed next to {sys.executable} (pip install pyright, "
                    "or the project's dev extra)")
    work = tmp_path_factory.mktemp("user")
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                  "--no-build-isolation", "-w", str(work / "dist"), str(ROOT)])
    assert built.returncode == 0, f"building the wheel failed:\n{built.stdout}\n{built.stderr}"
    (wheel,) = (work / "dist").glob("tapegrad-*.whl")
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")])
    assert made.returncode == 0, made.stderr
    python = work / "venv" / ("Scripts" if sys.platform == "win32" else "bin") / "python"
    done = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                 "--no-deps", str(wheel)])
    assert done.returncode == 0, f"installing the wheel failed:\n{done.stdout}\n{done.stderr}"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"]).stdout.strip())
    (site / "_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return Installed(wheel, python, site)


def _pyright(installed: Installed, folder: Path) -> dict[Path, list[Finding]]:
    """pyright over `folder` (a user's project) with the installed tapegrad; findings by file."""
    (folder / "pyrightconfig.json").write_text(json.dumps(USER_CONFIG))
    done = _run([str(PYRIGHT), "--outputjson", "-p", str(folder),
                 "--pythonpath", str(installed.python)])
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no JSON report (exit {done.returncode}):\n"
                    f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    out: dict[Path, list[Finding]] = {p.resolve(): [] for p in folder.glob("*.py")}
    for d in report["generalDiagnostics"]:
        out.setdefault(Path(d["file"]).resolve(), []).append(Finding(
            d["range"]["start"]["line"] + 1, d["severity"], d.get("rule", ""), d["message"]))
    return out


@pytest.fixture(scope="module")
def findings(installed: Installed, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, list[Finding]]:
    """One pyright run over copies of tests/typing's programs, findings by file name."""
    project = tmp_path_factory.mktemp("project")
    for path in [*ACCEPT, *REJECT]:
        shutil.copy(path, project / path.name)
    by_path = _pyright(installed, project)
    assert len(by_path) == len(ACCEPT) + len(REJECT)
    return {path.name: found for path, found in by_path.items()}


def _show(found: list[Finding]) -> str:
    return "\n".join(f"  line {f.line}: {f.severity} {f.rule}: {f.message}" for f in found)


def test_there_are_programs_of_both_kinds() -> None:
    assert len(ACCEPT) >= 3 and len(REJECT) >= 3
    names = {p.name for p in [*ACCEPT, *REJECT]}
    assert len(names) == len(ACCEPT) + len(REJECT), "the programs are checked by file name"
    for path in REJECT:
        assert EXPECT.search(path.read_text()), f"{path.name} has no '# expect:' comment"


def test_the_wheel_ships_its_types_license_and_version(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert "tapegrad/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(installed.wheel).read(metadata).decode()
    assert "License-Expression: MIT" in text
    assert "Classifier: Typing :: Typed" in text
    # pocl's wheels exist for Linux x86-64 only: elsewhere the dependency must not be asked for
    assert ("Requires-Dist: pocl-binary-distribution>=1.2; sys_platform == \"linux\" and "
            "platform_machine == \"x86_64\"") in text
    ran = _run([str(installed.python), "-c",
                "import tapegrad, sys; print(tapegrad.__version__); print(tapegrad.__file__)"])
    assert ran.returncode == 0, ran.stderr
    version, where = ran.stdout.split()
    assert version == tg.__version__ and re.fullmatch(r"\d+\.\d+\.\d+.*", version)
    assert Path(where).is_relative_to(installed.site), "the wheel's copy, not the source tree"


def test_a_user_sees_the_package_as_typed(installed: Installed, tmp_path: Path) -> None:
    """The control: the same check without py.typed reports the missing stub, so the programs'
    clean runs below do mean that pyright read the installed, typed package."""
    program = tmp_path / "uses_tapegrad.py"
    program.write_text("import tapegrad as tg\n\nprint(tg.Tape())\n")
    assert _pyright(installed, tmp_path)[program.resolve()] == []
    marker = installed.site / "tapegrad" / "py.typed"
    marker.unlink()
    try:
        found = _pyright(installed, tmp_path)[program.resolve()]
    finally:
        marker.touch()
    assert [f.rule for f in found] == ["reportMissingTypeStubs"], _show(found)


@pytest.mark.parametrize("path", ACCEPT, ids=[p.name for p in ACCEPT])
def test_accepted_programs_have_no_findings(
    path: Path, findings: dict[str, list[Finding]]
) -> None:
    found = [f for f in findings[path.name] if f.severity in ("error", "warning")]
    assert not found, f"pyright strict should accept {path.name}:\n{_show(found)}"


@pytest.mark.parametrize("path", REJECT, ids=[p.name for p in REJECT])
def test_rejected_programs_fail_exactly_where_marked(
    path: Path, findings: dict[str, list[Finding]]
) -> None:
    expected: dict[int, tuple[str, str | None]] = {}
    for n, text in enumerate(path.read_text().splitlines(), start=1):
        m = EXPECT.search(text)
        if m:
            expected[n] = (m[1], m[2])
    errors = [f for f in findings[path.name] if f.severity == "error"]
    got = {(f.line, f.rule) for f in errors}
    want = {(line, rule) for line, (rule, _) in expected.items()}
    assert got == want, (f"{path.name}: pyright's errors differ from the '# expect:' marks\n"
                         f"missing: {sorted(want - got)}\nunexpected: {sorted(got - want)}\n"
                         f"{_show(errors)}")
    for line, (rule, fragment) in expected.items():
        if fragment is None:
            continue
        messages = [f.message for f in errors if f.line == line and f.rule == rule]
        assert any(fragment in msg for msg in messages), (
            f"{path.name}:{line}: no {rule} message contains {fragment!r}:\n{messages}")


@pytest.mark.parametrize("path", ACCEPT, ids=[p.name for p in ACCEPT])
def test_accepted_programs_also_run(path: Path) -> None:
    """Their tg.typed run-time checks pass as well: the annotations are true, not just tidy."""
    namespace = runpy.run_path(str(path), run_name="accepted_program")
    namespace["main"]()
