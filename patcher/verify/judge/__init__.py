"""what judges a run: the checks on one model (one_model) over the decode loop that feeds them (decode_loop), one module or package per oracle (tokens, logits, rollback, drafter/, acceptance/, distribution, coverage/), what they share (calibration: the noise floor; neartie; routers), and generate() mode.
May import: subjects, models, plumbing; the stdlib, torch and transformers; never patcher outside patcher.verify.
"""
