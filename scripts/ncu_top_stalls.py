"""The SASS instructions with the most warp-stall samples in an Nsight Compute source page
(`ncu --import R.ncu-rep --page source --csv --print-source sass`, which device_env.sh's
profile_with_ncu keeps as R.sass.csv with FA4_NCU_SASS=1), with each one's share of all samples and
the instruction kinds' totals, so a device call can print them instead of carrying the whole page.

    python3 scripts/ncu_top_stalls.py R.sass.csv [--top 30]
"""
import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"') or line.startswith("Address"))
    rows = list(csv.DictReader(lines[start:]))
    column = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))

    def samples(row):
        try:
            return int(float(row[column] or 0))
        except ValueError:
            return 0
    total = sum(samples(r) for r in rows) or 1
    kinds = collections.Counter()
    for r in rows:
        words = [w for w in r["Source"].split() if not w.startswith("@")]  # past a predicate
        kinds[words[0].split(".")[0] if words else "?"] += samples(r)
    print(f"{len(rows)} instructions, {total} stall samples; by opcode:")
    print("  " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in kinds.most_common(12)))
    for r in sorted(rows, key=samples, reverse=True)[:args.top]:
        print(f"{100 * samples(r) / total:5.1f}%  {r['Address']:>8}  {r['Source'][:110]}")


if __name__ == "__main__":
    main()
