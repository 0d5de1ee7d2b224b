#!/usr/bin/env bash
# Install yggtree and its data packages into the current Python environment.
# Usage: scripts/setup.sh [cpu|cuda] [extra]   (default: cpu; the offline extra is always installed)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
target="${1:-cpu}"
extra="${2:-}"
spec="$here[offline${extra:+,$extra}]"
if [ "$target" = "cpu" ]; then
  python -m pip install -q -c "$here/constraints-cpu.txt" -e "$spec"
else
  python -m pip install -q -e "$spec"
fi
python -m pip install -q --no-deps -r "$here/requirements-data.txt"
