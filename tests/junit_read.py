"""Reading a --junit-xml report back as CI systems do: junitparser (a JUnit reader from the package index) for the
cases, and Jenkins' junit-10.xsd for the schema. The XSD is the copy pytest's own --junitxml output is tested
against; pytest ships it only in its source distribution, so it is fetched once with pip (cached beside the fixture
trees) and the schema check is skipped, saying so, where the package index cannot be reached."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class ReadCase:
    classname: str
    name: str
    passed: bool
    message: str | None
    kind: str | None
    text: str | None


def read_junit(path: Path) -> tuple[dict[tuple[str, str], ReadCase], dict[str, str], list]:
    """(cases by (classname, name), the first suite's properties, the suites) as junitparser reads them."""
    from junitparser import JUnitXml

    xml = JUnitXml.fromfile(str(path))
    suites = list(xml)
    cases: dict[tuple[str, str], ReadCase] = {}
    for suite in suites:
        for case in suite:
            result = case.result[0] if case.result else None
            key = (case.classname, case.name)
            assert key not in cases, f"duplicate test case {key}"
            cases[key] = ReadCase(
                classname=case.classname,
                name=case.name,
                passed=case.is_passed,
                message=result.message if result is not None else None,
                kind=result.type if result is not None else None,
                text=result.text if result is not None else None,
            )
    props = {p.name: p.value for p in suites[0].properties()} if suites else {}
    return cases, props, suites


def failed(cases) -> dict[tuple[str, str], ReadCase]:
    return {k: c for k, c in cases.items() if not c.passed}


_XSD_VERSION = "9.2.0"  # any pytest sdist carries testing/example_scripts/junit-10.xsd; pinned for a stable cache


def junit_xsd() -> Path:
    cache = Path(tempfile.gettempdir()) / f"ckpt-audit-junit-xsd-{os.getuid()}"
    xsd = cache / "junit-10.xsd"
    if xsd.is_file():
        return xsd
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        + [f"pytest=={_XSD_VERSION}", "-d", str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    sdist = cache / f"pytest-{_XSD_VERSION}.tar.gz"
    if proc.returncode != 0 or not sdist.is_file():
        pytest.skip(f"junit-10.xsd: pip could not fetch pytest's sdist ({proc.stderr.strip()[-200:]})")
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"pytest-{_XSD_VERSION}/testing/example_scripts/junit-10.xsd")
        tmp = cache / "junit-10.xsd.tmp"
        tmp.write_bytes(member.read())
        tmp.replace(xsd)
    return xsd


def assert_schema_valid(path: Path) -> None:
    import xmlschema

    xmlschema.XMLSchema(str(junit_xsd())).validate(str(path))
