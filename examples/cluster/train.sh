#!/usr/bin/env bash
# The one command each task runs, under every scheduler here: slurm.sbatch's srun and jobset.yaml's pods.
# The ViT example's Trainer, jax.distributed set up from the scheduler's own variables (SLURM's, or
# Kubernetes'), resuming from the newest checkpoint that verifies on however many tasks there are.
#
# From the environment:
#   WORKDIR           checkpoints, on storage every task reaches (required)
#   CONFIG            the ViT config: tiny, ti16, s16, b16, l16, h14 (default l16)
#   DEVICES_PER_TASK  empty: the accelerators JAX finds; a number: that many simulated CPU devices
#   STEPS             stop at this step (default: the config's total_steps)
#   STEP_TIMEOUT      seconds a step may hang before the task exits with status 124 (default 600)
#   STARTUP_TIMEOUT   the same for init, the restore and the first step with its compile (default 1800)
#   TRAIN_ARGS        more options of examples/vit/train.py, e.g. "--data elastic --save-every 100"
#   PYTHON            the interpreter (default: python on the PATH)
# Exits 0 when the run is done, 75 when a SIGTERM stopped it after a save (run it again), 124 on a hang.
set -euo pipefail
cd "$(dirname "$0")/../.."
devices=(--real-devices)
if [ -n "${DEVICES_PER_TASK:-}" ]; then devices=(--devices "$DEVICES_PER_TASK"); fi
steps=()
if [ -n "${STEPS:-}" ]; then steps=(--steps "$STEPS"); fi
# shellcheck disable=SC2086  # TRAIN_ARGS is split into options on purpose
exec "${PYTHON:-python}" examples/vit/train.py --config "${CONFIG:-l16}" --workdir "${WORKDIR:?set WORKDIR}" \
    "${devices[@]}" "${steps[@]}" --distributed --resume-auto --step-timeout "${STEP_TIMEOUT:-600}" \
    --startup-timeout "${STARTUP_TIMEOUT:-1800}" \
    --progress lines ${TRAIN_ARGS:-}
