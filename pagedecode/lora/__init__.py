"""LoRA adapters served over one base model: a request names its adapter (request.py), the
engine loads it from PEFT's files (adapter.py), keeps up to max_loras of them resident in stacked
device buffers (stacks.py, residency.py) and the forward adds each row's low-rank delta after
the targeted projections (kernels/lora.py)."""
