#!/usr/bin/env bash
# The shipped SmolLM2 heads (checkpoints/smollm2-135m) from nothing, in one command with a fixed seed (0):
#
#   ./quickstart.sh setup && PATH="$PWD/.venv/bin:$PATH" examples/train_shipped_heads.sh OUT_DIR
#
# The four steps of checkpoints/README.md, in order:
#   1. `postnorm` heads at exits 4 / 16 / 24 on the self-distillation corpus (16000 steps),
#   2. the residual block at L16, warm-started from step 1's L16 head (17176 steps),
#   3. the gates refit with text of their own (the model's answers to 400 fresh prompts),
#   4. `calibrate` to teacher-forced agreement >= 0.95 on the calibration prompts, saved to OUT_DIR with the
#      shipped router's hand-set fields (verify mode by default, exit acceptance prior 0.3).
# About four hours on 2 CPU threads (every step pins 2). OUT_DIR.work keeps each step's output and the cached
# hidden states (about 6 GB), so a step that fails can be rerun alone; OUT_DIR gets the calibrated router, step 3's
# training_report.json and step 4's calibration_report.json.
#
# Options after OUT_DIR go to every train-heads run, where the last of a repeated option wins: `--model` trains
# for another base, and smaller budgets make a quick trial run (the test suite runs it that way on a tiny model).
# EER_CALIBRATE_ARGS adds options to the calibrate run; EER_CLI replaces the `early-exit-router` command.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [train-heads options...]" >&2
    exit 2
fi
out="$1"
shift
work="$out.work"
read -r -a cli <<< "${EER_CLI:-early-exit-router}"
read -r -a calibrate_args <<< "${EER_CALIBRATE_ARGS:-}"
mkdir -p "$work"
# The cached hidden states in $work are reused by every later run into the same OUT_DIR, whatever its options: a
# trial run with small budgets must not feed a full one. So the options are stamped, and a run with other ones stops.
stamp="$work/options.txt"
options="$(printf '%q ' "$@") | ${EER_CALIBRATE_ARGS:-}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" != "$options" ]; then
    echo "$work holds hidden states cached for other options ($(cat "$stamp")): remove it or use another OUT_DIR." >&2
    exit 2
fi
echo "$options" > "$stamp"
exits=(--exit-layers 4,16,24 --adapter postnorm)
corpus=(--max-tokens 260000 --self-gen-tokens 128 --generated-prompts 500 --sampled --hidden-states "$work/states.pt")

"${cli[@]}" train-heads --out "$work/postnorm" "${exits[@]}" "${corpus[@]}" --max-steps 16000 \
    --seed 0 --threads 2 "$@"
"${cli[@]}" train-heads --out "$work/block" --init-from "$work/postnorm" "${exits[@]}" \
    --exit-adapters 16:residual_block --train-exits 16 "${corpus[@]}" --max-steps 17176 --lr 1e-3 --seed 0 \
    --threads 2 "$@"
"${cli[@]}" train-heads --out "$work/gates" --init-from "$work/block" "${exits[@]}" \
    --exit-adapters 16:residual_block --train-exits '' "${corpus[@]}" --gate-prompts 400 \
    --gate-hidden-states "$work/gate_states.pt" --seed 0 --threads 2 "$@"
"${cli[@]}" calibrate --model "$work/gates" --out "$out" --target-agreement 0.95 --delta 0.05 \
    --candidates 0.95,0.9,0.85,0.8,0.75,0.7,0.65 --mode verify --exit-acceptance-prior 0.3 \
    ${calibrate_args[@]+"${calibrate_args[@]}"}
cp "$work/gates/training_report.json" "$out/training_report.json"
echo "trained, calibrated and saved to $out (each step's output: $work)"
