#!/usr/bin/env python3
"""Charts of one forward benchmark run (bench/gpu_forward.py's forward.json): TFLOP/s per seqlen
of ours and each peer in that run, one panel per (head dim, causal), one PNG per dtype, drawn by
bench/report.py's prefill figure so they look like the suite report's. Runs anywhere with
matplotlib (no GPU, no PyTorch).

  python3 bench/forward_chart.py RUN.json OUTDIR    (writes OUTDIR/<RUN>-<dtype>.png)
"""
from __future__ import annotations

import json
import os
import sys

import report
from suite import LABELS


def suite_rows(rows):
    """forward.json rows in the suite's shape (timings under the direction "fwd"), so report.py's
    figure draws them."""
    keys = ("dtype", "head_dim", "causal", "seqlen")
    return [{**{k: r[k] for k in keys}, "fwd": {"tflops": r["tflops"], "ms": r["ms"]}} for r in rows]


def labels_of(rows):
    """Every implementation timed in the run, ours first, named as in the suite report."""
    names = sorted({n for r in rows for n in r["fwd"]["ms"]}, key=lambda n: (not n.startswith("flashattn"), n))
    return {n: LABELS.get(n, n) for n in names}


def main(argv):
    if len(argv) == 2 and argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0
    if len(argv) != 3:
        sys.exit(__doc__)
    path, out = argv[1], argv[2]
    with open(path) as f:
        rows = suite_rows(json.load(f)["rows"])
    labels = labels_of(rows)
    stem = os.path.splitext(os.path.basename(path))[0]
    os.makedirs(out, exist_ok=True)
    for dtype in sorted({r["dtype"] for r in rows}):
        chart = os.path.join(out, f"{stem}-{dtype}.png")
        report.prefill_figure([r for r in rows if r["dtype"] == dtype], dtype, "fwd", labels, chart)
        print(chart)


if __name__ == "__main__":
    main(sys.argv)
