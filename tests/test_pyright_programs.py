"""pyright (strict) on small user programs: tests/typing/accept passes, tests/typing/reject fails
exactly where its `# expect: <rule>[: message fragment]` comments say."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PROGRAMS = Path(__file__).parent / "typing"
ACCEPT = sorted((PROGRAMS / "accept").glob("*.py"))
REJECT = sorted((PROGRAMS / "reject").glob("*.py"))
PYRIGHT = Path(sys.executable).parent / "pyright"
EXPECT = re.compile(r"#\s*expect:\s*(\w+)(?::\s*(.+?))?\s*$", re.M)


@dataclass(frozen=True)
class Finding:
    line: int  # 1-based
    severity: str
    rule: str
    message: str


@pytest.fixture(scope="module")
def findings() -> dict[Path, list[Finding]]:
    """One pyright run over tests/typing (its own strict config), findings by file."""
    if not PYRIGHT.exists():
        pytest.skip(f"pyright is not installed next to {sys.executable} (pip install pyright, "
                    "or the project's dev extra)")
    done = subprocess.run(
        [str(PYRIGHT), "--outputjson", "-p", str(PROGRAMS), "--pythonpath", sys.executable],
        capture_output=True, text=True, timeout=300, check=False)
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no JSON report (exit {done.returncode}):\n"
                    f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    assert report["summary"]["filesAnalyzed"] == len(ACCEPT) + len(REJECT)
    out: dict[Path, list[Finding]] = {p.resolve(): [] for p in [*ACCEPT, *REJECT]}
    for d in report["generalDiagnostics"]:
        path = Path(d["file"]).resolve()
        out.setdefault(path, []).append(Finding(
            d["range"]["start"]["line"] + 1, d["severity"], d.get("rule", ""), d["message"]))
    return out


def _show(found: list[Finding]) -> str:
    return "\n".join(f"  line {f.line}: {f.severity} {f.rule}: {f.message}" for f in found)


def test_there_are_programs_of_both_kinds() -> None:
    assert len(ACCEPT) >= 2 and len(REJECT) >= 3
    for path in REJECT:
        assert EXPECT.search(path.read_text()), f"{path.name} has no '# expect:' comment"


@pytest.mark.parametrize("path", ACCEPT, ids=[p.name for p in ACCEPT])
def test_accepted_programs_have_no_findings(
    path: Path, findings: dict[Path, list[Finding]]
) -> None:
    found = findings[path.resolve()]
    assert not found, f"pyright strict should accept {path.name}:\n{_show(found)}"


@pytest.mark.parametrize("path", REJECT, ids=[p.name for p in REJECT])
def test_rejected_programs_fail_exactly_where_marked(
    path: Path, findings: dict[Path, list[Finding]]
) -> None:
    expected: dict[int, tuple[str, str | None]] = {}
    for n, text in enumerate(path.read_text().splitlines(), start=1):
        m = EXPECT.search(text)
        if m:
            expected[n] = (m[1], m[2])
    errors = [f for f in findings[path.resolve()] if f.severity == "error"]
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
