"""Parameters a module keeps in float32 whatever the model's dtype (DeepSeek-V4's norms, sinks, position biases,
hyper-connections and correction bias, as its reference keeps them)."""

import torch
from torch import nn

from engine.layers.moe import target_device


class KeepsFloat32(nn.Module):
    """A module whose own parameters named in ``float32_params`` survive a model-wide cast (``model.to(bfloat16)``)
    in float32, following the device only. ``_apply`` may overwrite a parameter's data in place: copies are kept."""

    float32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name).detach().clone() for name in self.float32_params
                if isinstance(getattr(self, name, None), nn.Parameter) and getattr(self, name).is_floating_point()}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            device = target_device(fn, value)
            moved = torch.empty_like(value, device=device) if value.is_meta else value.to(device)
            setattr(self, name, nn.Parameter(moved.float(), requires_grad=False))
        return self
