#!/usr/bin/env bash
# Fetches the demo corpus: Jane Austen's six novels, shipped by Debian as the R package
# r-cran-janeaustenr (data/Rdata.rdb). Downloads the .deb with `apt-get download` (R is not
# installed), unpacks it with dpkg-deb, and extracts one .txt per novel with `longtrain corpus`.
# Idempotent: each step is skipped when its result is already there, and each result appears under
# its final name only when complete.
#
# Usage: scripts/fetch-corpus.sh [--cache DIR] [--longtrain PATH]
#   --cache DIR       where to keep the .deb, its unpacked files and the texts (default: data-cache/)
#   --longtrain PATH  the longtrain binary (default: $LONGTRAIN_BIN, else build*/tools/longtrain/longtrain)
# The texts end up in DIR/janeausten/*.txt.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="$root/data-cache"
longtrain="${LONGTRAIN_BIN:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --cache) cache="$2"; shift 2 ;;
    --longtrain) longtrain="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "fetch-corpus: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

package=r-cran-janeaustenr
texts="$cache/janeausten"
if [ -f "$texts/.complete" ]; then
  echo "fetch-corpus: $texts already holds the corpus"
  exit 0
fi

if [ -z "$longtrain" ]; then
  for candidate in "$root"/build*/tools/longtrain/longtrain; do
    if [ -x "$candidate" ]; then longtrain="$candidate"; break; fi
  done
fi
if [ -z "$longtrain" ] || [ ! -x "$longtrain" ]; then
  echo "fetch-corpus: no longtrain binary found; build it (cmake --build build --target longtrain) or pass --longtrain PATH" >&2
  exit 1
fi

mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
texts="$cache/janeausten"

# 1. the .deb (apt-get download writes into the current directory)
deb="$(ls "$cache"/${package}_*.deb 2>/dev/null | head -n1 || true)"
if [ -z "$deb" ]; then
  work="$(mktemp -d "$cache/download.XXXXXX")"
  chmod 755 "$work"  # apt-get hands the download to its _apt user
  if ! (cd "$work" && apt-get download "$package"); then
    echo "fetch-corpus: apt-get download failed; updating the package lists and trying again" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    (cd "$work" && apt-get download "$package")
  fi
  mv "$work"/${package}_*.deb "$cache"/
  rmdir "$work"
  deb="$(ls "$cache"/${package}_*.deb | head -n1)"
fi

# 2. unpacked (not installed)
unpacked="$cache/$package"
rdb="$unpacked/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
if [ ! -f "$rdb" ]; then
  partial="$(mktemp -d "$cache/unpack.XXXXXX")"
  dpkg-deb -x "$deb" "$partial"
  rm -rf "$unpacked"
  # Another run may have finished first: then keep its copy.
  mv -T "$partial" "$unpacked" 2>/dev/null || rm -rf "$partial"
fi

# 3. the texts
partial="$(mktemp -d "$cache/janeausten.XXXXXX")"
chmod 755 "$partial"
"$longtrain" corpus "$rdb" --output "$partial"
touch "$partial/.complete"
rm -rf "$texts"
if ! mv -T "$partial" "$texts" 2>/dev/null; then
  rm -rf "$partial"
  [ -f "$texts/.complete" ] || { echo "fetch-corpus: could not move the texts into $texts" >&2; exit 1; }
fi
echo "fetch-corpus: corpus in $texts"
