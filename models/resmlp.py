"""Polynomial ResMLP: placeholder, filled in by the ResMLP work of issue 17."""
