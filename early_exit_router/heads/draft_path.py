"""A base-exact adapted draft path: copies of the model's first layers, adapted, that only drafts run.

`adapt-base --scope draft` trains a LoRA on layers 0..E alone, together with exit E's head, and writes it into a router
folder as a `{"format": "lora", "scope": "draft", "exit_layer": E}` adapted base. Loading it merges the LoRA into
copies of those layers (PEFT's own injection and merge, applied to the copies): the user's model is left
bit-identical, and drafting runs the copies over a KV cache of their own (`decode/adapted_draft.py`), while every
draft is verified by the untouched model from its embeddings. The price is the copies' weights (E + 1 layers) and
their cache, and verification passes that start at layer 0.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from early_exit_router.models._compat import quiet_peft


@dataclass
class DraftPath:
    """Adapted copies of layers 0..exit_layer (`layers[j]` runs in place of the model's layer j)."""

    exit_layer: int
    layers: list[nn.Module]

    def nbytes(self) -> int:
        """Memory of the copies' weights."""
        return sum(p.numel() * p.element_size() for layer in self.layers for p in layer.parameters())


def load_draft_path(stack: Any, folder: Path, entry: dict[str, Any]) -> DraftPath:
    """The draft path of router folder `folder` (its `adapted_base` entry of scope "draft") on `stack`'s model:
    copies of layers 0..E with the folder's LoRA merged into them; the model's own layers are not touched."""
    try:
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
        from peft.tuners.lora import LoraLayer
    except ImportError:
        raise ImportError(
            f"{folder} holds a LoRA draft path, which loads with PEFT: pip install 'early-exit-router[adapt]' "
            "(or peft)."
        ) from None
    from safetensors.torch import load_file

    exit_layer = int(entry["exit_layer"])
    if not 0 <= exit_layer < stack.num_layers - 1:
        raise ValueError(
            f"{folder}: the draft path's exit_layer {exit_layer} is not below this model's last layer: load it on "
            "the base it was trained on, or re-run adapt-base --scope draft."
        )
    copies = [copy.deepcopy(stack.layers[j]) for j in range(exit_layer + 1)]
    # The copies under the model's own module path, so that the adapter's names (and its config's
    # layers_to_transform) find them as they found the model's layers in training.
    root = box = nn.Module()
    *parents, leaf = stack.spec.layers.split(".")
    for name in parents:
        setattr(box, name, nn.Module())
        box = getattr(box, name)
    setattr(box, leaf, nn.ModuleList(copies))
    with quiet_peft():
        inject_adapter_in_model(LoraConfig.from_pretrained(str(folder)), root)
        weights = load_file(str(folder / "adapter_model.safetensors"))
        # PeftModel.save_pretrained names weights under its own wrapper: base_model.model.<the model's path>
        weights = {k.removeprefix("base_model.model."): v for k, v in weights.items()}
        loaded = set_peft_model_state_dict(root, weights)
    if loaded.unexpected_keys:
        raise ValueError(
            f"{folder}: the draft path's LoRA adapts more than layers 0..{exit_layer} "
            f"({loaded.unexpected_keys[0]}, ...): re-run adapt-base --scope draft."
        )
    for name, module in list(root.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()  # PEFT's arithmetic: W + scale * B A, in the layer's own dtype
            parent, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent), attr, module.get_base_layer())
    dtype = stack.dtype
    return DraftPath(exit_layer, [layer.to(dtype).eval().requires_grad_(False) for layer in copies])
