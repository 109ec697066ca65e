"""what is verified: the tree's decoders found statically (decoders), imported and bound (methods, binding), and upstream's own tests (upstream_tests).
May import: plumbing and the stdlib (torch only inside functions); never judge, models or process.
"""
