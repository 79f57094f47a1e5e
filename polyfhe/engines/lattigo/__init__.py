"""Lattigo through the orion-v2 wheels: client primitives, the hoisted-BSGS evaluator, bootstrapping keys."""
