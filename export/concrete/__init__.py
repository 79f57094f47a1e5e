"""Concrete ML's export side: compile a polynomial model to a TFHE circuit in the Concrete worker."""

from polyfhe.exporters.concrete.export import ConcreteExportError, export_concrete

__all__ = ["ConcreteExportError", "export_concrete"]
