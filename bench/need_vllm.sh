# Sourced by the bench/run_*.sh device wrappers (from the repository root): the ../shared/gpu bundle's
# packages in /tmp/site, installed from /tmp/gpu the first time; without them the wrapper stops with one line
# (a fresh machine: the bundle's parts were not copied in this lease).
[ -d /tmp/site/vllm ] || bash /tmp/gpu/install.sh /tmp/gpu /tmp/site 2>&1 | tail -1
[ -d /tmp/site/vllm ] || { echo "no vllm in /tmp/site: copy the bundle's parts to /tmp/gpu first" \
  "(../shared/gpu/README.md)"; exit 1; }
