"""Engine-neutral execution: the program executor over an engine's slot operations, the plaintext store, rotation
key chains. Loads with numpy only (no torch, no engine package)."""
