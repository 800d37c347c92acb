#!/usr/bin/env bash
# Renders kiln's SVG pictures (kiln plot, kiln inspect --memory --plot) to PNG with a
# headless Chromium, at the size the SVG declares (width/height of its <svg> element).
#   bash tools/render_svg.sh FILE.svg [OUT.png]      # OUT defaults to FILE.png
# Installs Debian's chromium package when no Chromium is found (as root or with sudo);
# only this script needs it (tools/install_deps.sh does not install it).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: render_svg.sh FILE.svg [OUT.png]" >&2; exit 2; }
svg=$1
out=${2:-${svg%.svg}.png}
[ -f "$svg" ] || { echo "render_svg: $svg: no such file" >&2; exit 1; }
browser=""
for b in chromium chromium-browser google-chrome; do
  if command -v "$b" >/dev/null; then browser=$b; break; fi
done
if [ -z "$browser" ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "render_svg: installing chromium (Debian package)"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
  browser=chromium
fi
# The declared size: <svg ... width="960.00" height="648.00" ...>.
head=$(grep -o '<svg [^>]*>' "$svg" | head -1)
w=$(sed -n 's/.* width="\([0-9.]*\)".*/\1/p' <<<"$head")
h=$(sed -n 's/.* height="\([0-9.]*\)".*/\1/p' <<<"$head")
[ -n "$w" ] && [ -n "$h" ] || { echo "render_svg: $svg: no width/height on its <svg> element" >&2; exit 1; }
w=${w%.*}
h=${h%.*}
abs=$(cd "$(dirname "$svg")" && pwd)/$(basename "$svg")
out_abs=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A page holding only the picture at its size, no margin.
cat >"$tmp/page.html" <<HTML
<!DOCTYPE html><html><head><style>html,body{margin:0;padding:0;background:#fff}</style></head>
<body><img src="file://$abs" width="$w" height="$h"></body></html>
HTML
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --allow-file-access-from-files \
  --window-size="$w,$h" --screenshot="$out_abs" "file://$tmp/page.html" >/dev/null 2>&1
[ -s "$out_abs" ] || { echo "render_svg: $browser wrote no $out" >&2; exit 1; }
echo "render_svg: wrote $out (${w}x${h})"
