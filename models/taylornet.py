"""TaylorNet / R-TaylorNet / Taylor-Mixer: placeholder, filled in by the TaylorNet work of issue 17."""
