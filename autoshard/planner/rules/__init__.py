"""Sharding rules, one module per op family; importing this package registers them all."""
from . import attention, conv, experts, linear, loss, norm, pointwise, shape  # noqa: F401  (registration)
from .registry import NodeInfo, OpStrategy, register_rule, register_shape_op, strategies

__all__ = ["NodeInfo", "OpStrategy", "register_rule", "register_shape_op", "strategies"]
