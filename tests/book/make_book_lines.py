"""Extract the book's ``[DEBUG]`` log lines into ``book_debug_lines.txt`` (committed).

The source chapters of *llama-nuts-and-bolts* live in the team's ``shared/seeds/`` folder,
which a user's clone does not have; this script copies their log lines verbatim into a small
fixture that ``tests/test_book_lines.py`` holds our log-line templates against.

    python3 tests/book/make_book_lines.py [--seeds ../shared/seeds]

Each output line is ``<seed file id>\t<the text between "[DEBUG] ... " and " ...">``, in book
order, duplicates within one chapter dropped.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SEEDS = HERE.parents[2] / "shared" / "seeds"
OUT = HERE / "book_debug_lines.txt"
# a chapter's rendered log line: "[DEBUG] ... <text> ..." (several may share one markdown line)
DEBUG_LINE = re.compile(r"\[DEBUG\] \.\.\. (.+?) \.\.\.(?= \[DEBUG\]|\s*$|\s*`)")


def extract(seeds: Path) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for path in sorted(seeds.glob("*.txt")):
        seen: set[str] = set()
        for line in path.read_text(encoding="utf-8").splitlines():
            for text in DEBUG_LINE.findall(line):
                if text not in seen:
                    seen.add(text)
                    rows.append((path.stem.split("_")[0], text))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=Path, default=DEFAULT_SEEDS, help="folder of the source chapters")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = extract(args.seeds)
    if not rows:
        raise SystemExit(f"no [DEBUG] lines found under {args.seeds}")
    header = ("# [DEBUG] lines of llama-nuts-and-bolts ch. 15-16, extracted by make_book_lines.py\n"
              "# seed\tline (000 = ch.15 Llama 3.1 8B, 003 = ch.15 Llama 2 7B, 004 = ch.16)\n")
    args.out.write_text(header + "".join(f"{seed}\t{text}\n" for seed, text in rows), encoding="utf-8")
    print(f"wrote {len(rows)} lines to {args.out}")


if __name__ == "__main__":
    main()
