#!/usr/bin/env bash
# Installs what tests/e2e/test_app_browser.py needs: Debian chromium + chromium-driver (never a downloaded browser)
# and the gradio + selenium packages into the active Python environment. Idempotent; safe to call from .ci/run.
# The apt-get step needs root (or sudo). TAGCLIP_SKIP_BROWSER=1 installs nothing (the browser test is then skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
case "$(echo "${TAGCLIP_SKIP_BROWSER:-}" | tr '[:upper:]' '[:lower:]')" in
    ""|0|false|no) ;;
    *) echo "TAGCLIP_SKIP_BROWSER is set: installing nothing; tests/e2e/test_app_browser.py skips the browser test"
       exit 0 ;;
esac
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    echo "installing Debian chromium + chromium-driver with apt-get (as root) for the demo's browser test"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
fi
PYTHON="${PYTHON:-python}"
if ! "$PYTHON" -c "import gradio, selenium" >/dev/null 2>&1; then
    # gradio caps pillow below 13; constraints.txt (when present) keeps torch/transformers at the tested pins
    CONSTRAINTS=()
    if [ -f constraints.txt ]; then CONSTRAINTS=(-c constraints.txt); fi
    "$PYTHON" -m pip install -q "${CONSTRAINTS[@]}" "gradio>=5.0,<7" "selenium>=4.20"
fi
chromium --version
chromedriver --version
"$PYTHON" -c "import gradio, selenium; print('gradio', gradio.__version__, 'selenium', selenium.__version__)"
