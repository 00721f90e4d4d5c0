"""addnorm: LayerNorm, RMSNorm and the residual add fused with them (Add & Norm),
forward and hand-written backward, for PyTorch."""

from .functional import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .nn import AddNorm, LayerNorm, RMSNorm
from .patch import patch, unpatch

__version__ = "0.1.0"

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
