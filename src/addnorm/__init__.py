"""addnorm: LayerNorm, RMSNorm and the residual add fused with them (Add & Norm),
forward and hand-written backward, for PyTorch."""

import torch.fx

from .functional import FX_LEAVES, add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .nn import AddNorm, LayerNorm, RMSNorm
from .patch import patch, unpatch

__version__ = "0.1.0"

for _name in FX_LEAVES:  # addnorm.layer_norm(...) is one node of a torch.fx graph too (functional.py)
    torch.fx.wrap(_name)

__all__ = [
    "AddNorm",
    "LayerNorm",
    "RMSNorm",
    "add_layer_norm",
    "add_rms_norm",
    "layer_norm",
    "patch",
    "rms_norm",
    "unpatch",
]
