"""what judges a run: the checks on one model and their rows, the logits and drafter oracles, the noise floor and near-ties, the reference decoders and acceptance, generate() mode.
May import: subjects, models, plumbing; the stdlib, torch and transformers; never patcher outside patcher.verify.
"""
