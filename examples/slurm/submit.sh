#!/usr/bin/env bash
# Submit SHARDS (4) array tasks of warm-array.sbatch, then check.sbatch to run once all of them succeeded.
# Run from the repository's checkout with examples/ci/common.sh's variables exported (sbatch passes them on).
set -euo pipefail
SHARDS=${SHARDS:-4}
warm=$(sbatch --parsable --export=ALL --array="0-$((SHARDS - 1))" examples/slurm/warm-array.sbatch)
sbatch --parsable --export=ALL --dependency="afterok:${warm%%;*}" examples/slurm/check.sbatch
