"""LPNN (Ladder Polynomial Neural Network): placeholder, filled in by the LPNN work of issue 17."""
