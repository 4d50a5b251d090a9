#!/bin/sh
# Install this mtpwrap bundle on a machine with no network. Needs python3 with its venv module;
# building llama-server from the carried source also needs cmake and a C++ compiler.
#
#   ./install.sh [--prefix DIR] [--public-key KEY.pem]
#
# Every file is checked against SHA256SUMS (and the signature, with --public-key) before
# anything is used. The bundle's venv goes to PREFIX/<bundle id>/ beside any earlier one;
# PREFIX/current and PREFIX/bin/mtpwrap then point at it. Builds, sources and models go to
# mtpwrap's cache (MTPWRAP_HOME, by default ~/.cache/mtpwrap), where `build`, `up` and `models`
# find them. A running `mtpwrap up` keeps its llama-server until `mtpwrap reload`.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
prefix=${MTPWRAP_PREFIX:-${HOME:?HOME is not set}/.local/share/mtpwrap}
pubkey=""
while [ $# -gt 0 ]; do
  case $1 in
    --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a folder." >&2; exit 2; }
              prefix=$2; shift 2 ;;
    --public-key) [ $# -ge 2 ] || { echo "install.sh: --public-key needs a file." >&2; exit 2; }
                  pubkey=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument '$1'; expected --prefix DIR or --public-key FILE." >&2
       exit 2 ;;
  esac
done

command -v python3 >/dev/null 2>&1 || {
  echo "install.sh: python3 is not installed; install Python 3 with its venv module." >&2; exit 1; }
# check.py needs 3.7; an older python3 is refused here, in one sentence, as a mismatch is there.
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 7))' 2>/dev/null; then
  want=$(sed -n 's/.*"python": "\([0-9.]*\)".*/\1/p' "$here/bundle.json" | head -n 1)
  echo "install.sh: this bundle is for Python ${want:-3.10 or newer}, and python3 here is" \
       "$(python3 -V 2>&1 | cut -d' ' -f2): install that Python, or make a bundle for this one." >&2
  exit 1
fi
python3 "$here/check.py" "$here" ${pubkey:+"$pubkey"} || exit 1
id=$(python3 "$here/check.py" --id "$here") || exit 1
requirement=$(python3 "$here/check.py" --requirement "$here") || exit 1
dest="$prefix/$id"

# A venv cannot be moved (its scripts name their own path), so it is made in place and marked
# complete last: a folder without the mark is an interrupted install, made again.
if [ ! -f "$dest/.complete" ]; then
  rm -rf "$dest"
  mkdir -p "$dest"
  python3 -m venv "$dest/venv" || {
    echo "install.sh: python3 -m venv failed; install the venv module (Debian: python3-venv)." >&2
    exit 1; }
  # Only the carried wheels: no index, and no pip configuration of this machine's.
  if ! PIP_CONFIG_FILE=/dev/null "$dest/venv/bin/python" -m pip install -q --no-index \
      --no-cache-dir --disable-pip-version-check --find-links "$here/wheels" "$requirement"; then
    rm -rf "$dest"
    echo "install.sh: pip could not install $requirement from $here/wheels (above); nothing" \
         "was installed." >&2
    exit 1
  fi
  touch "$dest/.complete"
fi

"$dest/venv/bin/mtpwrap" bundle install "$here" ${pubkey:+--public-key "$pubkey"}
ln -sfn "$id" "$prefix/current"
mkdir -p "$prefix/bin"
ln -sfn ../current/venv/bin/mtpwrap "$prefix/bin/mtpwrap"
echo "installed bundle $id: $prefix/bin/mtpwrap (add $prefix/bin to PATH)"
