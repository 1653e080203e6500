"""Where a kernel's warps wait, from Nsight Compute's per-instruction SASS page.

Reads the CSV that scripts/gpu_profile.sh writes per kernel-name regex (FLASHATTN_PROFILE_SASS,
`ncu --page source --print-source sass --csv`) and prints, per opcode, the instructions executed
and the warp-stall samples, then the stall reasons; with a second CSV, both side by side (e.g.
ours against FA2's backward). A CSV that holds several launches of the kernel is divided by
their count, so the columns compare one launch each.

  python3 bench/sass_stalls.py sass-backward_kernel.csv [sass-flash_bwd_dq_dk_dv.csv]
"""
import argparse
import collections
import csv

KEEP_SUFFIX = ("LDS", "STS", "HMMA", "LDSM", "REDG", "F2FP", "MUFU")  # opcodes whose variants differ in cost


def opcode(source):
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    base = op.split(".")[0]
    return ".".join(op.split(".")[:2]) if base in KEEP_SUFFIX else base


def number(text):
    return float(text.replace(",", "") or 0)


def summarize(path):
    rows = list(csv.reader(open(path)))
    headers = [i for i, r in enumerate(rows) if r and r[0] == "Address"]
    if not headers:
        raise SystemExit(f"{path}: no SASS table (is it ncu's --page source --csv output?)")
    header = rows[headers[0]]
    data = [r for r in rows[headers[0] + 1:] if len(r) == len(header) and r[0] != "Address"]
    launches = len(headers)
    src = header.index("Source")
    executed = header.index("Instructions Executed")
    samples = header.index("Warp Stall Sampling (All Samples)")
    reasons = [j for j, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    per_op, samples_per_op, per_reason = collections.Counter(), collections.Counter(), collections.Counter()
    for r in data:
        op = opcode(r[src])
        per_op[op] += number(r[executed]) / launches
        samples_per_op[op] += number(r[samples]) / launches
        for j in reasons:
            per_reason[header[j]] += number(r[j]) / launches
    return per_op, samples_per_op, per_reason


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="one or two per-kernel SASS CSVs")
    args = parser.parse_args()
    tables = [summarize(p) for p in args.csv[:2]]
    ops = sorted(set().union(*(t[0] for t in tables)), key=lambda o: -tables[0][0][o])
    print(f"{'opcode':<16}" + "".join(f"{'executed':>14}{'stall samples':>15}" for _ in tables))
    for op in ops:
        if max(t[0][op] for t in tables) >= 1e5:
            print(f"{op:<16}" + "".join(f"{t[0][op]:>14.0f}{t[1][op]:>15.0f}" for t in tables))
    print(f"{'total':<16}" + "".join(f"{sum(t[0].values()):>14.0f}{sum(t[1].values()):>15.0f}" for t in tables))
    print()
    for reason in sorted(tables[0][2], key=lambda k: -tables[0][2][k]):
        print(f"{reason:<28}" + "".join(f"{t[2][reason]:>14.0f}" for t in tables))


if __name__ == "__main__":
    main()
