# Arguments shared by the launch scripts (sourced, not run). Every knob is an environment variable.
TP=${TP:-1}
DATA=${DATA:-mixed}
MICRO_BATCH_TOKENS=${MICRO_BATCH_TOKENS:-8192}
KV_BUDGET=${KV_BUDGET:-8GiB}
TRAIN_ITERS=${TRAIN_ITERS:-100}
MODEL_ARGS=()
if [[ -n "${HF_DIR:-}" ]]; then MODEL_ARGS=(--hf-dir "$HF_DIR"); else MODEL_ARGS=(--model "${MODEL:-tiny-llama}"); fi
# Megatron's convention: --load and --save name the same folder, so a restarted job (torchrun
# --max-restarts, a requeued Slurm job) resumes from its latest checkpoint; until the first
# save it starts from HF_DIR / MODEL.
LOAD=${LOAD:-${SAVE:-}}
if [[ -n "$LOAD" ]]; then MODEL_ARGS+=(--load "$LOAD"); fi
TRAIN_ARGS=(
  "${MODEL_ARGS[@]}" --data "$DATA" --tensor-model-parallel-size "$TP"
  --micro-batch-tokens "$MICRO_BATCH_TOKENS" --kv-cache-budget "$KV_BUDGET" --train-iters "$TRAIN_ITERS"
  --optimizer adam --lr "${LR:-1e-6}" --clip-grad 1.0 --loss-agg "${LOSS_AGG:-token-mean}"
  --distributed-timeout-minutes "${DIST_TIMEOUT_MINUTES:-10}"
  ${SAVE:+--save "$SAVE" --save-interval "${SAVE_INTERVAL:-50}"} ${LOG_JSON:+--log-json "$LOG_JSON"}
)
# The environment of a GPU job (every variable can be set before; these are the defaults):
# one hardware queue per device, so that megatron's tensor-parallel communication is issued in
# the order the compute stream reaches it (megatron asks for it with sequence parallelism);
# NCCL errors raised, not hung on; InfiniBand retries long enough for a busy fabric.
gpu_environment() {
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  # (NCCL_SOCKET_IFNAME / NCCL_IB_HCA: the cluster's; left to the job when set)
}
if [[ "${DEVICE:-auto}" != "cpu" ]] && python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  TRAIN_ARGS+=(--bf16)
  gpu_environment
fi
# shellcheck disable=SC2206
TRAIN_ARGS+=(${EXTRA_ARGS:-})
