"""For scripts/vllm/bench.py's MooncakeConnector servers only (on their PYTHONPATH): vLLM's
MooncakeConnector worker asks ``torch.accelerator.current_device_index()`` when it starts, and
this venv's torch (a CUDA build) raises "Found no NVIDIA driver" there on a machine without a
GPU. Without an accelerator the index is 0; nothing else on the connector's CPU path uses it."""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
