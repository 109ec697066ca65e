"""Settings of the ddpatch runtime, in one place.

Every submodule reads these through this module at call time, so that setting
``_ddpatch_runtime.options.TREE_STRATEGY = "node"`` (or ``patcher.runtime.TREE_STRATEGY``,
which the package forwards here) reaches all of them.
"""

from __future__ import annotations

#: How a tree verify runs the GDN layers: "auto" (default: "onepass" where the module's layout
#: allows it, see ``fastpath``), "onepass", "node" (node-recurrent) or "path" (path-batched).
TREE_STRATEGY = "auto"

#: Use the Gated DeltaNet fast path where the module's layout allows it (False: generic module replay only).
GDN_FAST_PATH = True

#: How a chain commit replays the delta rule: "closed" (own closed form), "kernel" (the
#: module's kernel on the kept prefix) or "auto" (closed on CPU, kernel elsewhere).
GDN_CHAIN_REPLAY = "auto"

#: What the runtime does where it cannot be sure a commit is exact (a cache it cannot read, a
#: record whose length no longer matches, a concurrent verify, ...): "raise" (default: decoding
#: never goes on after a possibly wrong commit) or "warn" (a RuntimeWarning, and decoding goes
#: on, possibly lossy; for debugging only).
ON_UNCERTAIN = "raise"

#: The oldest transformers release the runtime serves (measured: ``ddpatch demo`` passes from 5.21.0;
#: the reasons for the releases before it are in ``errors._check_transformers_version``).
MIN_TRANSFORMERS = "5.21.0"

SETTINGS = ("TREE_STRATEGY", "GDN_FAST_PATH", "GDN_CHAIN_REPLAY", "ON_UNCERTAIN", "MIN_TRANSFORMERS")
