#!/usr/bin/env bash
# Make this checkout small enough to travel to a lent GPU machine (a run carries at most 64 MiB: tracked files and
# untracked files git does not ignore), and back. The bundled target's weights (models/demo-target, 58 MB) stay
# behind; tools/device/cuda_check.py makes its models from models/demo-draft where it runs.
#
#   bash tools/device/leave_behind.sh on     # models/demo-target untracked here and ignored (.git/info/exclude)
#   bash tools/device/leave_behind.sh off    # tracked again, exactly as committed (run it right after the device run)
#   bash tools/device/leave_behind.sh size   # the bytes that would travel now
#
# Nothing is deleted: the files stay in the working tree; only git's index and .git/info/exclude change, locally.
# While it is on, `git status` shows the folder as deleted from the index: do not commit then (on refuses to
# start with staged changes, and off restores the index).
set -euo pipefail
cd "$(dirname "$0")/../.."
LEFT=models/demo-target
EXCLUDE=.git/info/exclude
size() {
  git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
    | awk '{s += $1} END {printf "%d bytes (%.1f MiB) would travel\n", s, s / 1048576}'
}
case "${1:-}" in
  on)
    if ! git diff --cached --quiet; then
      echo "leave_behind: there are staged changes; commit or unstage them first" >&2
      exit 1
    fi
    git rm -r -q --cached -- "$LEFT"
    grep -qxF "/$LEFT/" "$EXCLUDE" 2>/dev/null || echo "/$LEFT/" >> "$EXCLUDE"
    echo "leave_behind: $LEFT stays behind (untracked, ignored); 'off' restores it"
    size
    ;;
  off)
    git reset -q -- "$LEFT"
    if [ -f "$EXCLUDE" ]; then
      grep -vxF "/$LEFT/" "$EXCLUDE" > "$EXCLUDE.tmp" || true
      mv "$EXCLUDE.tmp" "$EXCLUDE"
    fi
    git diff --quiet -- "$LEFT" || { echo "leave_behind: $LEFT differs from the commit" >&2; exit 1; }
    echo "leave_behind: $LEFT tracked again"
    size
    ;;
  size) size ;;
  *) echo "usage: $0 on|off|size" >&2; exit 2 ;;
esac
