"""the acceptance oracle: reference_decode (the from-scratch decoders, the one reference walk), floor (a shipped pair's stored floor), pair_reference (any pair's floor, in the run), verdict (the acceptance: METHOD row).
May import: the rest of judge (calibration, drafter), models, plumbing and check, relatively; the stdlib, torch and transformers.
"""
