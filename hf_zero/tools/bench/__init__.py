"""hf-zero bench: one causal LM trained under DDP, FSDP2, torch's ZeroRedundancyOptimizer, DeepSpeed ZeRO-1/2/3 and
hf_zero stages 0-3, side by side (base: settings and the Trainer interface; runner: spawn and measure; trainers and
deepspeed: the systems; lockstep; load; plot; cli). The capacity table and the two-namespace-host bench need root:
they are the checkout's benchmarks/ (`python -m benchmarks.capacity`, `python -m benchmarks.two_hosts`), not this
package."""
