#!/usr/bin/env bash
# The ranks of one LWS worker pod: GPUS_PER_NODE processes, rank LWS_WORKER_INDEX * GPUS_PER_NODE + i on GPU i,
# of a world of LWS_GROUP_SIZE * GPUS_PER_NODE ranks whose rank 0 (the engine) runs in the leader pod.
# The engine is built anew each time a gateway attaches, and its ranks meet again from scratch: each rank
# process is started again when it ends (its engine stopped, or nobody came to the meeting in time).
set -euo pipefail
: "${LWS_LEADER_ADDRESS:?set by LeaderWorkerSet}" "${LWS_WORKER_INDEX:?}" "${LWS_GROUP_SIZE:?}"
: "${GPUS_PER_NODE:?}" "${MASTER_PORT:?}"
world=$((LWS_GROUP_SIZE * GPUS_PER_NODE))
for ((i = 0; i < GPUS_PER_NODE; i++)); do
  (
    while true; do
      RANK=$((LWS_WORKER_INDEX * GPUS_PER_NODE + i)) LOCAL_RANK=$i WORLD_SIZE=$world \
        MASTER_ADDR=$LWS_LEADER_ADDRESS MASTER_PORT=$MASTER_PORT \
        moegate engine-rank --device=cuda || true
      sleep 2
    done
  ) &
done
wait
