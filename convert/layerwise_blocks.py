"""The pieces a layer-wise conversion refines with: the converted attention block built from its planned
tensors, its query/key-side parameter names, and two decoder layers run as one module (the window
targets of :data:`~gqakit.convert.refine_names.REFINE_TARGETS`). Used by :mod:`gqakit.convert.layerwise`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gqakit.convert.plan import OutputTensor, execute
from gqakit.convert.refine import converted_attention, layer_output
from gqakit.convert.registry import ArchAdapter, Role


class Window(torch.nn.Module):
    """Two adjacent decoder layers run as one module: ``first`` on its call arguments, then ``second``
    on ``first``'s output with its own (``rest``, ``kwargs``: what the model passes it)."""

    def __init__(self, first: torch.nn.Module, second: torch.nn.Module, positional: bool) -> None:
        super().__init__()
        self.first, self.second, self.positional = first, second, positional

    def forward(self, args: tuple, kwargs: dict, rest: tuple, next_kwargs: dict) -> torch.Tensor:
        h = layer_output(self.first(*args, **kwargs))
        out = (
            self.second(h, *rest, **next_kwargs)
            if self.positional
            else self.second(*rest, hidden_states=h, **next_kwargs)
        )
        return layer_output(out)


# The query/key side that --refine-qk-lr covers: the q and k projections and every norm on them.
_QK_ROLES: tuple[Role, ...] = ("q", "k", "q_norm", "k_norm", "q_norm_flat", "k_norm_flat")
# Per-head norms (stablelm): one module per head, named by the container that holds them all.
_QK_PER_HEAD_ROLES: tuple[Role, ...] = ("q_norm_per_head", "k_norm_per_head")


def qk_parameters(adapter: ArchAdapter, layer: int, path: str, block: torch.nn.Module) -> list[str]:
    """The names, in ``block`` (the attention module at ``path``), of the query/key-side parameters:
    the q and k projections and their norms (none for a fused qkv projection)."""
    found = [adapter.module(r, layer) for r in _QK_ROLES]
    for role in _QK_PER_HEAD_ROLES:
        template: str | None = getattr(adapter, role)
        if template is not None:  # "...k_layernorm.norms.{head}" -> the container "...k_layernorm.norms"
            found.append(template.split(".{head}", 1)[0].format(layer=layer))
    mods = [m[len(path) + 1 :] for m in found if m and m.startswith(path + ".")]
    return [n for n, _ in block.named_parameters() if any(n.startswith(m + ".") for m in mods)]


def planned_block(
    original: torch.nn.Module,
    config,
    layer: int,
    device: torch.device,
    path: str,
    outs: list[OutputTensor],
    read: Callable[[str], torch.Tensor],
) -> torch.nn.Module:
    """The converted attention block of ``layer`` in float32, with the planned (merged) weights."""
    block = converted_attention(original, config, layer, device)
    by_name = {o.name: o for o in outs}
    with torch.no_grad():
        for n, p in block.named_parameters():
            full = f"{path}.{n}"
            if full not in by_name:
                raise RuntimeError(f"layer-wise conversion: no planned tensor for {full}")
            p.copy_(execute(by_name[full], read).to(p.dtype))
    return block


__all__ = ["Window", "planned_block", "qk_parameters"]
