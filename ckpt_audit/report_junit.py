"""JUnit XML: a command's result as test cases, the report CI systems (GitHub Actions, GitLab, Jenkins, Buildkite)
show case by case. The one writer of the format, for scan, verify, continuity and resume-test.

Standard library only, and imported only when --junit-xml is given (scan's start-up is unchanged). The shape is
what Jenkins' junit-10.xsd (the schema pytest's own --junitxml is checked against) accepts and what GitLab and the
GitHub test-report actions read: <testsuites> holding one <testsuite name tests failures errors skipped time
timestamp> with <properties> (the command line, the versions) and one <testcase classname name time> per compared
item, a failing one carrying <failure message type> with the detail as its text.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata

from ckpt_audit.models import Finding, Severity

VERSIONED = ("ckpt-audit", "torch", "verl")


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    classname: str
    """The group a CI system files the case under (e.g. `resume-test.restore`, a run's `project/experiment`)."""
    name: str
    failure: str | None = None
    """One-line message when the case failed; None when it passed."""
    kind: str = "failure"
    """The failure's `type` attribute: a finding code, or what kind of difference."""
    detail: str = ""
    """The failure's text, or the passed case's system-out (what was compared, findings below --fail-on)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Suite:
    name: str
    cases: tuple[Case, ...]
    properties: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0


def command_properties(extra: Iterable[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """The command line as typed and the installed versions of ckpt-audit, torch and verl (read from package
    metadata: nothing is imported)."""
    line = shlex.join(["ckpt-audit", *sys.argv[1:]])
    return (("command", line), *((f"version.{p}", _version(p)) for p in VERSIONED), *extra)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def finding_case(findings: Sequence[Finding], fail_on: Severity, *, classname: str, name: str) -> Case:
    """One case for one judged thing (a checkpoint, a run, a resume point) and its findings: it fails on the first
    finding at or above `fail_on`, as the exit code does; every finding is listed in its text."""
    failing = [f for f in findings if f.severity >= fail_on]
    detail = "\n".join(_finding_line(f) for f in findings)
    if not failing:
        return Case(classname=classname, name=name, detail=detail)
    first = failing[0]
    more = f" (+{len(failing) - 1} more)" if len(failing) > 1 else ""
    return Case(
        classname=classname,
        name=name,
        failure=f"{first.code}: {first.message}{more}",
        kind=first.code,
        detail=detail,
    )


def _finding_line(f: Finding) -> str:
    rank = f" [rank {f.rank}]" if f.rank is not None else ""
    return f"{f.severity.label} {f.code} {f.path}{rank}: {f.message}"


def scan_suite(result, fail_on: Severity, *, name: str) -> Suite:
    """scan/verify: one case per checkpoint (named by its directory, filed under its run's name, or its path where
    two runs share a name), one per run with run-level findings (tracker, layout), and one per path with findings
    outside any run."""
    cases: list[Case] = []
    outside: dict[str, list[Finding]] = {}
    for f in result.findings:
        outside.setdefault(f.path, []).append(f)
    cases += [finding_case(fs, fail_on, classname=name, name=path) for path, fs in outside.items()]
    names = [run.name for run in result.runs]
    for run in result.runs:
        group = run.name if names.count(run.name) == 1 else run.path  # two demo/exp runs: tell them apart
        if run.findings:
            cases.append(finding_case(run.findings, fail_on, classname=group, name="run"))
        for c in run.checkpoints:
            case = finding_case(c.all_findings, fail_on, classname=group, name=os.path.basename(c.path))
            status = f"status {c.status.value}, {len(c.all_files)} files"
            cases.append(
                Case(
                    classname=case.classname,
                    name=case.name,
                    failure=case.failure and f"{c.status.value}: {case.failure}",
                    kind=case.kind,
                    detail="\n".join(filter(None, [status, case.detail])),
                )
            )
    seconds = (result.finished_ns - result.started_ns) / 1e9
    return Suite(name=name, cases=tuple(cases), properties=command_properties(), seconds=seconds)


def continuity_suite(result, fail_on: Severity) -> Suite:
    """continuity: one case per resume point (its judgement and findings), one for findings at no resume point."""
    classname = f"continuity.{result.metric}"
    cases = []
    at_points: set[int] = set()
    for pr in result.points:
        p, j = pr.point, pr.judgement
        at_points.update(id(f) for f in pr.findings)
        score = f"score {j.score:+.1f} / {result.threshold:g}" if j.sufficient else "no verdict (too few points)"
        case = finding_case(pr.findings, fail_on, classname=classname, name=f"resume from step {p.resume_step}")
        cases.append(
            Case(
                classname=classname,
                name=case.name,
                failure=case.failure,
                kind=case.kind,
                detail="\n".join(filter(None, [f"first logged step {p.first_step}; {score}", case.detail])),
            )
        )
    rest = [f for f in result.findings if id(f) not in at_points]
    if rest or not result.points:
        cases.append(finding_case(rest, fail_on, classname=classname, name="log"))
    return Suite(name="continuity", cases=tuple(cases), properties=command_properties())


def render(suites: Sequence[Suite], *, timestamp: float | None = None) -> bytes:
    """The XML document (UTF-8, with declaration)."""
    from xml.etree import ElementTree as ET

    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() if timestamp is None else timestamp))
    root = ET.Element("testsuites", name="ckpt-audit")
    for suite in suites:
        failures = sum(c.failure is not None for c in suite.cases)
        el = ET.SubElement(
            root,
            "testsuite",
            name=suite.name,
            tests=str(len(suite.cases)),
            failures=str(failures),
            errors="0",
            skipped="0",
            time=f"{suite.seconds:.3f}",
            timestamp=stamp,
            hostname=socket.gethostname(),
        )
        if suite.properties:
            props = ET.SubElement(el, "properties")
            for key, value in suite.properties:
                ET.SubElement(props, "property", name=key, value=_clean(value))
        for case in suite.cases:
            tc = ET.SubElement(el, "testcase", classname=_clean(case.classname), name=_clean(case.name), time="0.000")
            if case.failure is not None:
                fail = ET.SubElement(tc, "failure", message=_clean(case.failure), type=_clean(case.kind))
                fail.text = _clean(case.detail or case.failure)
            elif case.detail:
                ET.SubElement(tc, "system-out").text = _clean(case.detail)
    root.set("tests", str(sum(len(s.cases) for s in suites)))
    root.set("failures", str(sum(c.failure is not None for s in suites for c in s.cases)))
    root.set("errors", "0")
    root.set("time", f"{sum(s.seconds for s in suites):.3f}")
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def _clean(text: str) -> str:
    """XML 1.0 cannot carry control characters, lone surrogates (a finding may quote a garbage file name, decoded
    with surrogateescape) or U+FFFE/U+FFFF: write them as \\xNN (the original byte for a surrogate-escaped one)."""
    return "".join(c if _allowed(ord(c)) else f"\\x{_byte(ord(c)):02x}" for c in text)


def _allowed(n: int) -> bool:
    return n in (0x9, 0xA, 0xD) or 0x20 <= n < 0xD800 or 0xE000 <= n < 0xFFFE or n > 0xFFFF


def _byte(n: int) -> int:
    return n - 0xDC00 if 0xDC80 <= n <= 0xDCFF else n


def write_junit(path: str, suites: Sequence[Suite]) -> None:
    """Write atomically (a temporary file beside it, then rename): a CI step never reads half a report."""
    data = render(suites)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".junit-", suffix=".xml", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
