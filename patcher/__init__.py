"""ddpatch: compatibility recipes for speculative-decoding research code, and a verifier that proves them lossless."""

__version__ = "0.1.0"
