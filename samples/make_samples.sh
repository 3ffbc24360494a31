#!/usr/bin/env bash
# Render the sample diagrams shown in samples/README.md from a real run of the default model
# (SmolLM2-135M-Instruct Q4_1, fetched once by `llamatrace pull`) on samples/prompt.txt.
#   bash samples/make_samples.sh
# Needs Graphviz's `dot` (bash scripts/setup.sh installs it). Takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

prompt=(--prompt-file samples/prompt.txt)
[ -f samples/prompt.txt ] || prompt=()        # the command's default prompt: "The capital of France is"

for ext in svg png; do
  llamatrace diagram "${prompt[@]}" -o "samples/diagram_model.$ext"                                  # the whole model
  llamatrace diagram "${prompt[@]}" --view block -o "samples/diagram_block.$ext"                     # one block in detail
  llamatrace diagram "${prompt[@]}" --view block --highlight 10 -o "samples/diagram_stage10.$ext"    # the book's STAGE 10
done

# the pictures of README's "Looking inside" (matplotlib)
llamatrace attention --raw "The capital of France is" --layer 5 -o samples/attention.png
llamatrace lens --raw "The capital of France is" -o samples/lens.png > /dev/null

# the screenshot of the interactive page (needs chromium, chromium-driver and selenium: setup.sh --test)
python3 scripts/page_screenshot.py
