"""hf-zero bench: one causal LM trained under DDP, FSDP2, torch's ZeroRedundancyOptimizer, DeepSpeed ZeRO-1/2/3 and
hf_zero stages 0-3, side by side (base: settings and the Trainer interface; runner: spawn and measure; trainers and
deepspeed: the systems; plot; cli)."""
