#!/usr/bin/env bash
# Set up llamatrace on a fresh machine: Graphviz's `dot` (for SVG/PNG/PDF diagrams) and the
# Python package. `--test` also installs what the test suite needs (with apt: Debian's chromium and
# chromium-driver for the browser tests of `diagram -o run.html`).
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --test   # runtime + tests
set -euo pipefail
cd "$(dirname "$0")/.."
# every apt-get waits up to 10 min for the dpkg lock another apt-get holds, rather than give up at once
apt_get="apt-get -o DPkg::Lock::Timeout=600"

if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo_cmd="sudo"
    echo "setup: installing Graphviz (dot) with apt-get" >&2
    { $sudo_cmd $apt_get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd $apt_get install -y -qq graphviz >/dev/null; } \
      || echo "setup: could not install graphviz; diagrams can still be written as .dot" >&2
  elif command -v brew >/dev/null 2>&1; then
    brew install graphviz || echo "setup: could not install graphviz; diagrams can still be written as .dot" >&2
  else
    echo "setup: Graphviz 'dot' not found; install it for SVG/PNG/PDF diagrams (.dot output works without it)" >&2
  fi
fi

extra=""
if [ "${1:-}" = "--test" ]; then
  extra="[test,ray]"   # ray: the --ray tests start a local cluster
  if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo_cmd="sudo"
    echo "setup: installing chromium and chromium-driver with apt-get (browser tests of the .html page)" >&2
    { $sudo_cmd $apt_get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_cmd $apt_get install -y -qq chromium chromium-driver >/dev/null; } \
      || echo "setup: could not install chromium; the browser tests will skip" >&2
  fi
fi
python3 -m pip install --disable-pip-version-check -q -e ".${extra}"
# Numba compiles each kernel the first time it runs and caches it: do it now, once, rather than
# in a user's first command (the default model in both activation modes, then the matmul
# kernels of the common quant types; minutes on 2 quiet cores, many more on a busy
# machine: docs/development.md "Set-up time"; a second when already cached)
echo "setup: compiling the kernels (once; cached afterwards)" >&2
python3 -m llamatrace generate --raw -n 2 "Hello" >/dev/null 2>&1 || python3 -m llamatrace generate --raw -n 2 "Hello" >/dev/null
python3 -m llamatrace generate --raw -n 2 --activations q8 "Hello" >/dev/null 2>&1 || true     # q8 needs AVX2
python3 -m llamatrace.kernels.precompile
