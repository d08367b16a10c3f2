-- The GPU demonstration (README, "RL on one GPU"): SFT warm-up then DAPO on multiplication (four digits by one) with the
-- ~220 M-parameter model of examples/gpu_model.lua, on CUDA device 0 in bf16.
--   ds4 run examples/dapo.lua --config examples/configs/dapo_mul_gpu.lua
-- Every value can still be changed on the command line (--steps 50, --device cuda:1, ...).
task = "mul"
arch = "gpu"
device = "cuda"
dtype = "bf16"
eval = 500
eval_every = 10
sft_steps = 250
sft_batch = 128
sft_lr = 1e-3
steps = 100
prompts = 64
n = 8
lr = 5e-5
log_completions = 50
