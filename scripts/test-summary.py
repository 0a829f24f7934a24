#!/usr/bin/env python3
"""Print the closing lines of `make test`: every failed case by name, then one count line.

Reads the JUnit XML files pytest wrote and the molecule result file under out/test-results/.
The failures are printed last, beside the count, because CI shows only the tail of the log.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

results = Path(sys.argv[1] if len(sys.argv) > 1 else "out/test-results")
passed = failed = skipped = 0
failures: list[str] = []
for xml in sorted(results.glob("*.xml")):
    root = ET.parse(xml).getroot()
    for suite in root.iter("testsuite"):
        total = int(suite.get("tests", 0))
        bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skip = int(suite.get("skipped", 0))
        passed += total - bad - skip
        failed += bad
        skipped += skip
    for case in root.iter("testcase"):
        for outcome in case:
            if outcome.tag in ("failure", "error"):
                message = " ".join((outcome.get("message") or "").split())[:300]
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failures.append(f"{xml.stem}: {outcome.tag.upper()} {name}: {message}")
molecule = results / "molecule.txt"
if molecule.exists():
    fields = dict(line.split("=", 1) for line in molecule.read_text().split())
    passed += int(fields.get("passed", 0))
    failed += int(fields.get("failed", 0))
    if fields.get("names"):
        failures.append(f"molecule: FAILED scenarios {fields['names']}")
for line in failures:
    print(line)
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
