"""Runs `flashattn run ... --json` and checks its exit status and verdict (ctest's cli_* tests).

    cli_run_check.py --status N --passed true|false|null -- FLASHATTN run ARGS... --json

The report must be one JSON object whose "passed" is the given value; when something was
checked, every result in check.results must carry the rule's numbers and agree with "passed".
"""
import argparse
import json
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--status", type=int, required=True)
    parser.add_argument("--passed", choices=["true", "false", "null"], required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    r = subprocess.run(command, capture_output=True, text=True, timeout=600)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    if r.returncode != args.status:
        print(f"exit status {r.returncode}, expected {args.status}")
        return 1
    report = json.loads(r.stdout)
    expected = {"true": True, "false": False, "null": None}[args.passed]
    if report["passed"] is not expected:
        print(f'"passed": {report["passed"]}, expected {expected}')
        return 1
    check = report["check"]
    if expected is None:
        return 0 if not check["done"] and "results" not in check else 1
    results = check["results"]
    for name, c in results.items():
        keys = {"max_abs_error", "tolerance", "mean_abs_error", "mean_tolerance", "passed"}
        if not keys <= c.keys():
            print(f"{name}: missing {keys - c.keys()}")
            return 1
        if c["passed"] and not c["max_abs_error"] <= c["tolerance"]:
            print(f"{name}: passed with an error above its tolerance")
            return 1
    if all(c["passed"] for c in results.values()) is not expected or bool(check["failures"]) == expected:
        print("check.results / check.failures disagree with \"passed\"")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
