#!/usr/bin/env python3
"""Print one closing line for `make test`: every pytest case and molecule scenario counted.

Reads the JUnit XML files pytest wrote and the molecule result file under out/test-results/.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

results = Path(sys.argv[1] if len(sys.argv) > 1 else "out/test-results")
passed = failed = skipped = 0
for xml in sorted(results.glob("*.xml")):
    for suite in ET.parse(xml).getroot().iter("testsuite"):
        total = int(suite.get("tests", 0))
        bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skip = int(suite.get("skipped", 0))
        passed += total - bad - skip
        failed += bad
        skipped += skip
molecule = results / "molecule.txt"
if molecule.exists():
    fields = dict(line.split("=", 1) for line in molecule.read_text().split())
    passed += int(fields.get("passed", 0))
    failed += int(fields.get("failed", 0))
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
