"""Print what ddpatch does today with every drift variant (apply exit, statuses, verify).

    python tests/drift/table.py [VARIANT ...] [--no-verify] [--json FILE]

Not a test: a report for people. The assertions live in tests/test_drift.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drift import outcome  # noqa: E402
from drift.variants import BY_NAME, NOT_A_DECODER, VARIANTS  # noqa: E402

SHORT = {"applied": "A", "already-applied": "AA", "fixed-upstream": "F", "no-match": "NM", "skipped": "-"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="*")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from-record", type=Path, help="print the table from a DDPATCH_DRIFT_RECORD file of a pytest run")
    args = parser.parse_args()
    if args.from_record:
        return print_record(args.from_record)
    chosen = [BY_NAME[n] for n in args.variants] if args.variants else VARIANTS
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddpatch-drift-") as tmp:
        tmp = Path(tmp)
        for v in chosen:
            began = time.perf_counter()
            src = v.make(tmp / v.name / "src")
            rep = outcome.apply(src, tmp / v.name / "out", tmp / "home")
            row = {
                "variant": v.name,
                "expected": v.describe_expected(),
                "apply": rep.exit_code,
                "statuses": rep.statuses,
                "no_match": rep.no_match_sites(),
                "error": rep.error or (rep.raw[-400:] if rep.exit_code == 99 else None),
            }
            if rep.exit_code == 0 and not args.no_verify:
                ver = outcome.verify(tmp / v.name / "out")
                row["verify"] = ver.describe()
                missing = outcome.required_lossless(v.base, v.methods) - ver.lossless
                if ver.passed and missing:
                    row["verify"] = f"pass, but without {sorted(missing)}"
            elif rep.exit_code != 0:
                chk = outcome.check(src, tmp / "home")
                row["check"] = chk.exit_code
            if v.expected == NOT_A_DECODER:
                row["meets_expectation"] = rep.exit_code == 2 and (rep.error or "").startswith("no DDTree/DFlash decoder found")
            elif rep.exit_code == 0:
                row["meets_expectation"] = v.lossless and (args.no_verify or row.get("verify", "").startswith("pass"))
            else:
                row["meets_expectation"] = (
                    not v.lossless and row.get("check") == outcome.EXIT_NO_MATCH
                    and not outcome.unexpected_no_matches(rep.sites("no-match"), v.expected)
                )
            row["seconds"] = round(time.perf_counter() - began, 1)
            rows.append(row)
            statuses = " ".join(f"{k}={SHORT.get(s, s)}" for k, s in row["statuses"].items())
            print(f"## {v.name} [{v.drift}] apply={row['apply']} check={row.get('check', '-')} ({row['seconds']} s)")
            print(f"   statuses: {statuses}")
            if row["no_match"]:
                print(f"   no-match: {'; '.join(row['no_match'])}")
            if row.get("error"):
                print(f"   error: {row['error']}")
            if "verify" in row:
                print(f"   verify: {row['verify']}")
            print(f"   expected: {row['expected']} -> {'OK' if row['meets_expectation'] else 'NOT MET'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def print_record(path: Path) -> int:
    rows: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        rows.setdefault(entry.pop("variant"), {}).update(entry)
    print("| variant | apply | statuses | check / no-match | verify | expected |")
    print("|---|---|---|---|---|---|")
    for v in VARIANTS:
        row = rows.get(v.name)
        if row is None:
            continue
        statuses = " ".join(f"{k}={SHORT.get(s, s)}" for k, s in row.get("statuses", {}).items())
        nm = "; ".join(row.get("check_no_match") or row.get("no_match") or [])
        check = f"{row['check']}: {nm}" if "check" in row else (nm or "-")
        verify = row.get("verify", "-" if row.get("apply") != 0 else "(not run)")
        expected = v.describe_expected()
        print(f"| {v.name} | {row.get('apply')} | {statuses} | {check} | {verify} | {expected} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
