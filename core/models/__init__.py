"""Our model implementations (tensor-parallel layers, paged attention) and their loader."""

from specray.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
