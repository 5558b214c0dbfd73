#!/usr/bin/env bash
# The second pass of `make test` / `make test-fast`: where tf.keras is Keras 3 in the first
# pass (TensorFlow 2.16+ without $TF_USE_LEGACY_KERAS), the tests marked keras2 that run in
# the tests' process ran skipped there; they run here with tf.keras as Keras 2. Where the first
# pass had Keras 2 as tf.keras (TensorFlow 2.15, or the variable set), it ran them: nothing to do.
# Usage: tests/keras2_pass.sh PYTHON
set -euo pipefail
python=$1
if [[ "${TF_USE_LEGACY_KERAS:-}" =~ ^(1|true|True)$ ]]; then
    exit 0
fi
env=$("$python" -c "from hvdx import legacy_keras; print(' '.join(f'{k}={v}' for k, v in legacy_keras.keras2_env().items()))")
if [[ -z "$env" ]]; then
    exit 0
fi
echo "tests/keras2_pass.sh: the keras2 tests with $env"
exec env $env "$python" -m pytest -m "keras2 and not multirank"
