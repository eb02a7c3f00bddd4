#!/usr/bin/env bash
# Re-cut a ../shared/gpu/bundle.sh output into parts of SIZE (e.g. 48M) instead of its 48 MiB: a device call
# carries at most 64 MiB with the working tree, so the parts can grow as far as the tree leaves room (SGLang's
# 1.1 GB: 20 parts of 55M instead of 23 when the tree was 7 MiB). The tree is 15 MiB since session 17 (its
# bench/results), so 55M parts are refused now; 48M fit. At 22 MB (session 21) 48M parts were refused and 36M
# went; the overshoot files in bench/results are gzipped since, and the tree is 17 MB at the end of session
# 21: 44M parts fit beside it (48M do not). install.sh and MANIFEST stay in part00; install.sh joins
# bundle.tar.* as before. Session 26: with bench/results moved out of the tree for the bundle's calls
# (`mv bench/results /tmp/results_hold`, back after the last device call) the tree is 1.1 MB and 62M parts
# fit: 7 calls instead of 11 (58 s held, machine start included, on four H200s).
# Usage: bash bench/resplit_bundle.sh DIR SIZE
set -euo pipefail
dir=${1:?usage: resplit_bundle.sh DIR SIZE}; size=${2:?usage: resplit_bundle.sh DIR SIZE}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp "$dir/part00/install.sh" "$dir/part00/MANIFEST" "$tmp/"
cat "$dir"/part*/bundle.tar.* > "$tmp/bundle.tar"
rm -rf "$dir"; mkdir -p "$dir"
(cd "$tmp" && split -b "$size" -d -a 2 bundle.tar bundle.tar. && rm bundle.tar)
i=0
for p in "$tmp"/bundle.tar.*; do
  d=$(printf '%s/part%02d' "$dir" "$i"); mkdir -p "$d"; mv "$p" "$d/"; i=$((i+1))
done
mv "$tmp/install.sh" "$tmp/MANIFEST" "$dir/part00/"
echo "[resplit] $i parts of at most $size in $dir" >&2
