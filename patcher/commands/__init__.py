"""The ``ddpatch`` commands, one module per command or small group, and what they share (``base``).
They import api, config, report, results, errors and env only (never the engine or verify); patcher.cli imports them."""
