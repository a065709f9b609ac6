"""Capture: an `nn.Module` and example inputs -> a `torch.fx.GraphModule` with shapes.

Takes the user's model (symbolic_trace or torch.export, repeated layers traced once); hands on
a graph in autoshard's normal forms whose nodes carry FakeTensor values (`shapes`), the dims that
follow the inputs' batch and sequence sizes (`dynamic`), and what each op's arguments mean (`ops`).
"""
from .trace import Captured, apart, capture, has_meta

__all__ = ["Captured", "apart", "capture", "has_meta"]
