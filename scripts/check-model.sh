#!/usr/bin/env bash
# The model check of the claim protocol (model/; docs/design.md, "The protocol, model-checked"): every scenario
# exhaustively, breadth-first, then every mutation until it is caught. Prints what it found and ends with one line
#   model: states=N depth=D properties=K violations=V mutations=C/M caught
# and exits non-zero on any violation or uncaught mutation. Arguments go to the model binary, e.g.
#   scripts/check-model.sh --show "a row locked by a batch that lost its key is left for the re-open"
# prints a shortest path to that property's example (or counterexample) instead.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
exec cargo run --release -p fine-settler-model --locked --quiet -- "$@"
