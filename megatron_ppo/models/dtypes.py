"""The torch dtype of each `model.params_dtype` name: the one table the transformer config and the kernel probe
read (in a module of its own, below both)."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
