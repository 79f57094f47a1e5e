"""The exporters, installed as ``polyfhe.exporters``: ``onnx`` (fold, export, parity check), ``ckks`` (the CKKS
compiler) and ``concrete`` (Concrete ML's export side). The public entry point is :func:`polyfhe.export`."""
