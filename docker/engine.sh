#!/usr/bin/env bash
# Start a Docker engine if none answers (Debian's docker.io, as root, host networking only: this
# kind of machine has no bridge or iptables). Prints "started" when it started one, else "running".
# `engine.sh stop` stops an engine that this script started (and only that one).
set -euo pipefail
pidfile=/run/sao-dockerd.pid
if [ "${1:-}" = stop ]; then
  [ -f "$pidfile" ] || exit 0
  pid=$(cat "$pidfile"); rm -f "$pidfile"
  kill -TERM "$pid" 2>/dev/null || exit 0
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 1; done
  echo "dockerd $pid did not stop within 60 s" >&2; exit 1
fi
if docker info >/dev/null 2>&1; then echo running; exit 0; fi
command -v dockerd >/dev/null || { echo "dockerd is not installed (apt-get install docker.io)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "no Docker engine runs and only root can start one" >&2; exit 1; }
log=${SAO_DOCKERD_LOG:-/var/log/sao-dockerd.log}
setsid dockerd --iptables=false --ip-masq=false --bridge=none >"$log" 2>&1 < /dev/null &
echo $! > "$pidfile"
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then echo started; exit 0; fi
  sleep 1
done
echo "dockerd did not answer within 60 s; see $log" >&2
tail -20 "$log" >&2
exit 1
