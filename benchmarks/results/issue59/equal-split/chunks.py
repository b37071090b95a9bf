"""Prompt chunks beside decode rows in traced agent runs (``traced_decodes.py --trace``):
how often each size was taken, and what the steps with one 64- or 65-token chunk cost.

Usage, from this folder::

    python3 chunks.py TRACE.json [TRACE.json ...]
"""

import collections
import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    for path in sys.argv[1:]:
        decodes = json.loads(Path(path).read_text())["decodes"]
        sizes: collections.Counter[int] = collections.Counter()
        single: dict[int, list[float]] = collections.defaultdict(list)
        for decode in decodes:
            tokens = [item[2] for item in decode["items"]]
            rows = sum(1 for num in tokens if num == 1)
            chunks = [num for num in tokens if num > 1]
            if not rows:
                continue
            sizes.update(chunks)
            if len(chunks) == 1 and rows == 3:
                single[chunks[0]].append(decode["t1"] - decode["t0"])
        total = sum(d["t1"] - d["t0"] for d in decodes)
        print(f"{path}: {len(decodes)} decodes, {total:.1f} s in them")
        print(
            f"  chunks beside rows: {sum(sizes.values())}, of 64 tokens {sizes[64]}, 65 {sizes[65]}"
        )
        print(f"  most taken: {sizes.most_common(8)}")
        for size in (64, 65):
            if single[size]:
                median = 1000 * statistics.median(single[size])
                print(
                    f"  one {size}-token chunk beside 3 rows: {len(single[size])} steps, "
                    f"median {median:.0f} ms"
                )


if __name__ == "__main__":
    main()
