"""Where the warps of one profiled launch wait, from Nsight Compute's SASS source page (``gpu_session.sh profile``
writes it as ``profile-sass.csv``): ``python scripts/ncu_stalls.py profile-sass.csv [--top N]``.

Prints the stall samples of each part of the SASS between ``USETMAXREG`` instructions (with ``gl.warp_specialize``
each partition's code starts with one, so a part is roughly a partition) with its leading stall reasons, then the
``--top`` instructions by samples with their part and two leading reasons; a branch back to an mbarrier try-wait
loop is shown with the try-wait it returns to (its barrier's shared address names the barrier).
"""
from __future__ import annotations

import argparse
import collections
import csv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def count(row, name):
        value = row[col[name]]
        return int(value) if value not in ("", "-") else 0

    part, parts = 0, []
    for row in data:
        part += "USETMAXREG" in row[1]
        parts.append(part)
    samples, by_reason = collections.Counter(), collections.defaultdict(collections.Counter)
    for p, row in zip(parts, data):
        samples[p] += count(row, "Warp Stall Sampling (All Samples)")
        for name in reasons:
            by_reason[p][name] += count(row, name)
    total = sum(samples.values())
    print(f"stall samples: {total}")
    for p in sorted(samples):
        if samples[p] >= 0.01 * total:
            leading = ", ".join(f"{name[6:]} {n / total:.1%}" for name, n in by_reason[p].most_common(6))
            print(f"part {p}: {samples[p] / total:.1%} ({parts.count(p)} instructions): {leading}")
    address = {row[0]: i for i, row in enumerate(data)}
    for i in sorted(range(len(data)), key=lambda i: -count(data[i], "Warp Stall Sampling (All Samples)"))[:args.top]:
        row, text = data[i], data[i][1].strip()
        leading = sorted(((count(row, name), name[6:]) for name in reasons), reverse=True)[:2]
        target = address.get(text.split()[-1]) if "BRA" in text else None
        loop = f"  -> {data[target][1].strip()}" if target is not None and "TRYWAIT" in data[target][1] else ""
        share = count(row, "Warp Stall Sampling (All Samples)") / total
        print(f"{i:5d} part {parts[i]} {share:6.2%} {text[:60]:60s} {leading}{loop}")


if __name__ == "__main__":
    main()
