"""The engine runtime: engine dirs, decoding strategies, sampling and verification."""
