#!/usr/bin/env bash
# Install the services that the study tests use (Debian packages): PostgreSQL (initdb/pg_ctl under
# /usr/lib/postgresql/<version>/bin; the tests start a throwaway server themselves, nothing keeps
# running) and headless Chromium with its WebDriver (/usr/bin/chromium, /usr/bin/chromedriver).
# Does nothing when they are already installed. Measured here: apt-get update + installing
# chromium and chromium-driver took 36 s (postgresql was already installed).
set -euo pipefail
have_pg() { compgen -G "/usr/lib/postgresql/*/bin/initdb" > /dev/null; }
if have_pg && command -v chromium > /dev/null && command -v chromedriver > /dev/null; then
  echo "services: postgresql and chromium are installed"
  exit 0
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq postgresql chromium chromium-driver > /dev/null
echo "services: installed postgresql, chromium, chromium-driver in $(( $(date +%s) - start )) s"
