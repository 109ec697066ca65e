"""ddpatch: compatibility recipes for speculative-decoding research code, and a verifier that proves them lossless.

Layers, top down (each imports only those below it): ``cli`` (click) -> ``api`` (the Python API)
-> ``ci`` -> ``engine`` and ``verify`` -> ``report`` (renderers) -> ``results`` and ``errors``
(plain data). ``runtime`` stands alone: it is copied into patched trees.
"""

__version__ = "0.1.0"
