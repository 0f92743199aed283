"""The model families, one self-contained Hub custom-code unit each."""
