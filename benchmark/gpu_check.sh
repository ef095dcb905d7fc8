#!/usr/bin/env bash
# The GPU check in parts, each fitting one short loan of a GPU machine (about 9 minutes of commands): its stages, their
# limits and the ledger of what has passed are in benchmark/gpu_check.py (Python's standard library only); docs/gpus.md.
#
#   bash benchmark/gpu_check.sh --next                                # the part the next loan runs, and its command
#   bash benchmark/gpu_check.sh --part 1 OUT_DIR                      # part 1 in at most 540 s: OUT_DIR gets summary.md
#                                                                     # and results.tgz, nothing else
#   bash benchmark/gpu_check.sh --part 1 --dry_run OUT_DIR            # its stages, limits, estimates, commands (DRY_RUN=1)
#   bash benchmark/gpu_check.sh --record OUT_DIR --device_minutes 14  # its results under benchmark/results/gpu/, a ledger line
#
# The stages run with $PYTHON (default python3); so does this script.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/gpu_check.py" "$@"
