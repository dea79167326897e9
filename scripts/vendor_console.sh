#!/usr/bin/env bash
# Fetches the console's chart library, uPlot, from the npm registry at its
# pinned version and checks the registry's integrity hash, then copies its
# files into crates/rialto-gateway/console/vendor/ (`make console-vendor`).
# With --check, it only says whether the committed files are those.
set -euo pipefail
VERSION=1.6.32
INTEGRITY=sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==
DEST=crates/rialto-gateway/console/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$VERSION" > /dev/null)
tarball="$work/uplot-$VERSION.tgz"
actual="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w0)"
if [ "$actual" != "$INTEGRITY" ]; then
  echo "uplot@$VERSION: integrity $actual, expected $INTEGRITY" >&2
  exit 1
fi
tar -xzf "$tarball" -C "$work"
status=0
for file in uPlot.iife.min.js uPlot.min.css; do
  if [ "${1:-}" = --check ]; then
    cmp -s "$work/package/dist/$file" "$DEST/$file" || { echo "$DEST/$file differs from uplot@$VERSION" >&2; status=1; }
  else
    cp "$work/package/dist/$file" "$DEST/$file"
  fi
done
[ "${1:-}" = --check ] || cp "$work/package/LICENSE" "$DEST/uPlot.LICENSE"
[ $status -eq 0 ] && echo "uplot@$VERSION in $DEST"
exit $status
