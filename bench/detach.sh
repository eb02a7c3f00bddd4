#!/usr/bin/env bash
# One long job on the device machine over several `run` calls (each at most 600 s), with no gap between its
# parts: `start` copies the working tree to DIR/repo and runs the command there in a process session of its own
# (which outlives the call that started it, until the machine goes back: the device README), with OUT=DIR;
# `wait` returns when the job has ended or after SECONDS, prints the end of its log and copies DIR's files, and
# a tar of each PATH named (what the job has written so far), to the call's $OUT. Queue the calls back to back:
# a machine goes back 30 s after a call ends.
#   bash bench/detach.sh start DIR -- CMD [ARG ...]
#   bash bench/detach.sh wait DIR SECONDS [PATH ...]
# Session 23's seed pairs on one H100, e.g. (the first call after the bundle's install, then `wait` calls):
#   LIMIT=1420 bash bench/detach.sh start /tmp/job -- bash bench/run_gpu_partial_pairs.sh --gpus 1 ...
#   bash bench/detach.sh wait /tmp/job 530 /tmp/rft_pairs_out
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-}; dir=${2:-}
[ -n "$dir" ] || { echo "usage: detach.sh start DIR -- CMD ... | detach.sh wait DIR SECONDS [PATH ...]"; exit 2; }
case $what in
  start)
    [ "${3:-}" = "--" ] && [ $# -ge 4 ] || { echo "detach.sh start DIR -- CMD: the command is missing"; exit 2; }
    shift 3
    # DIR is emptied: only an absolute path that is new or an earlier job's (never the tree or a folder of it)
    case $dir in /*) ;; *) echo "detach.sh start: DIR must be an absolute path, not '$dir'"; exit 2;; esac
    if [ -e "$dir" ] && [ ! -f "$dir/job.pid" ]; then
      echo "detach.sh start: $dir exists and is not an earlier job's folder (no job.pid): name a new one"; exit 2
    fi
    rm -rf "$dir" && mkdir -p "$dir/repo" || exit 1
    tar --exclude=./.gpu --exclude='./.gpu-*' -cf - . | tar -C "$dir/repo" -xf - || exit 1
    (cd "$dir/repo" && OUT="$dir" exec setsid nohup "$@" > "$dir/job.log" 2>&1 < /dev/null) &
    echo $! > "$dir/job.pid"
    echo "[detach] started pid $(cat "$dir/job.pid") in $dir/repo: $*";;
  wait)
    seconds=${3:?detach.sh wait DIR SECONDS [PATH ...]}; shift 3
    pid=$(cat "$dir/job.pid") || exit 1
    end=$((SECONDS + seconds))
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then state="still running"; else state="ended"; fi
    tail -n 20 "$dir/job.log"
    echo "[detach] pid $pid $state"
    if [ -n "${OUT:-}" ]; then
      find "$dir" -maxdepth 1 -type f -exec cp {} "$OUT/" \;
      for p in "$@"; do [ -e "$p" ] && tar -C "$p" -czf "$OUT/$(basename "$p").tgz" .; done
    fi;;
  *) echo "detach.sh: start or wait, not '$what'"; exit 2;;
esac
