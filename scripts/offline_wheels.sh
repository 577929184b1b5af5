#!/usr/bin/env bash
# Wheels for an offline GPU machine (no network, a Python without a venv of
# its own), moved in parts no larger than a transfer allows.
#
#   Here (with network):
#     scripts/offline_wheels.sh pack DIR [PART_SIZE] -- REQUIREMENT ...
#       downloads the wheels (no dependencies; CPython 3.12, manylinux
#       x86_64), tars them and splits the tar into DIR/wheels.tar.part-*
#       of PART_SIZE (default 48M) each.
#   There (offline), once every part has been copied into one folder:
#     scripts/offline_wheels.sh install PARTS_DIR TARGET
#       joins the parts, checks the tar, and installs every wheel into
#       TARGET (pip --no-deps --no-index --target); then run with
#       PYTHONPATH=TARGET, which puts those packages ahead of the image's.
#
# Example, jax 0.12.0.1 with the CUDA 13 plugin:
#   scripts/offline_wheels.sh pack .whl12 48M -- jax==0.12.0.1 jaxlib==0.12.0.1 \
#       jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1
set -euo pipefail

pack() {
  local dir=$1 size=48M
  shift
  if [ "${1:-}" != "--" ]; then size=$1; shift; fi
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || { echo "pack: name at least one requirement after --" >&2; exit 2; }
  local tmp
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp" "$@"
  mkdir -p "$dir"
  rm -f "$dir"/wheels.tar.part-*
  tar -C "$tmp" -cf - . | split -b "$size" - "$dir/wheels.tar.part-"
  (cd "$tmp" && sha256sum ./*.whl) > "$dir/wheels.sha256"
  rm -rf "$tmp"
  ls -l "$dir"
}

install() {
  local parts=$1 target=$2 tmp
  tmp=$(mktemp -d)
  cat "$parts"/wheels.tar.part-* | tar -C "$tmp" -xf -
  if [ -f "$parts/wheels.sha256" ]; then (cd "$tmp" && sha256sum -c --quiet "$parts/wheels.sha256"); fi
  python3 -m pip install -q --no-deps --no-index --no-compile --target "$target" "$tmp"/*.whl
  rm -rf "$tmp"
  echo "installed into $target: run with PYTHONPATH=$target"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  pack) pack "$@" ;;
  install) install "$@" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
