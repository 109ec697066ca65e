"""Write ``tests/slow_tests.txt``: the tests a JUnit report of the suite measured over a number of seconds, which
``tests/conftest.py`` then marks ``slow`` (left out of the fast tier, ``-m "not slow"``; the README's command still runs
them). The fast tier stays within its budget as tests grow: rerun this on a fresh report (CONTRIBUTING.md, "tiers").

    python3 -m pytest -q --junitxml=/tmp/suite.xml          # the README's command, with a report
    python3 tools/slow_tests.py /tmp/suite.xml --over 3     # rewrites tests/slow_tests.txt
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "slow_tests.txt"


def measured(report: Path) -> dict[str, float]:
    """node id (as pytest names it, without xdist's ``@group``) -> seconds, for every test case of the report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        out[f"{module}::{case.get('name', '').split('@')[0]}"] = float(case.get("time") or 0)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a JUnit XML report of the suite (pytest --junitxml)")
    parser.add_argument("--over", type=float, default=5.0, help="seconds over which a test is slow (default 5)")
    parser.add_argument("--keep", action="store_true", help="keep the tests already listed (only add)")
    args = parser.parse_args(argv)
    times = measured(args.report)
    slow = {nid for nid, t in times.items() if t > args.over}
    if args.keep and OUT.exists():
        slow |= {line.split()[0] for line in OUT.read_text().splitlines() if line and not line.startswith("#")}
    lines = [f"# tests measured over {args.over:g} s in one run of the suite (tools/slow_tests.py): tests/conftest.py marks them",
             "# slow, so the fast tier (-m \"not slow\") leaves them out; the README's command runs them. One node id a line."]
    lines += sorted(slow)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"{len(slow)} tests over {args.over:g} s written to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
