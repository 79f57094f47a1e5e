"""Polynomial model zoo: MONet and PolyNeXt families behind a timm-style registry."""

from polyfhe.models.registry import ModelEntry, create_model, list_models, model_entry, register_model

__all__ = ["ModelEntry", "create_model", "list_models", "model_entry", "register_model"]
